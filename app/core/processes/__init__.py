"""The deployment's processes: who is up, and the children that end with their supervisor.

Owns: every process's presence record, the one way each keeps it (``Presence``) and its reads,
with its /metrics address (``presence``); child processes that do not outlive `inferq up` or
`inferq worker --gpus` (``lifeline``); a process's settings read again, what it built from them
dropped (``environment``). May import: the rooms of the floor
below (``contract``, ``messaging``, ``storage``, ``tenants``) and the ground; nothing of
``webhooks``.
"""
