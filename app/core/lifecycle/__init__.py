"""A job's life (docs/architecture.md, "Job states").

Owns: what follows a committed change, as data (``after``); **the one owner of a job's status
and sent sub-state** (``transitions``); the one construct that commits a change and then runs
what follows (``changes``); the job service: a request becomes a row once (``jobs``); the one
write path of a webhook event's redelivery (``deliveries``). May import: ``scheduling`` and
everything below it.
"""
