"""The deployment's processes: who is up, and the children that end with their supervisor.

Owns: the reads of every process's presence record and of its /metrics address
(``presence``; workers/presence.py writes a worker's); child processes that do not outlive
`inferq up` or `inferq worker --gpus` (``lifeline``). May import: the rooms of the floor
below (``contract``, ``messaging``, ``storage``, ``tenants``) and the ground; nothing of
``webhooks``.
"""
