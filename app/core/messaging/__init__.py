"""What one inferq process says to another through Redis, and the names they share.

Owns: every shared name, the queues and Redis keys (``names``); this process's Redis clients,
dropped by one reset (``clients``); Celery messages, the dispatcher's wake-ups and the control
channel, the only kombu importer (``broker``); a running job's output relayed to the API call
that waits for it (``relay``). May import: the ground only (it uses ``settings``).
"""
