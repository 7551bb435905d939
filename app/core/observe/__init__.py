"""What the system shows of itself, read afresh at every call (docs/observability.md).

Owns: each lane's jobs, tenants' shares, throughput and drain estimates (``snapshot``; what a
snapshot holds, and its JSON form, ``shapes``); the
parts a deployment lacks, whose work waits with no process to do it (``missing``). May import:
``scheduling`` and everything below it; nothing of ``openai``.
"""
