"""The heap of a long-lived process: what its start built is frozen out of the collector.

A full (generation 2) collection walks every object the collector tracks. After start that is
all of FastAPI, SQLAlchemy, Celery and pydantic's classes and schemas, hundreds of thousands
of objects that live as long as the process: measured, 40-80 ms per full collection in the API
and in a worker, a pause that every call in flight waits out (docs/benchmarks.md, "overhead",
the start-up heap). ``gc.freeze()`` moves what is alive into a permanent generation that collections
skip (measured: a full collection after the API's start took 30-45 ms, after ``freeze`` under
1 ms); what the process allocates afterwards is collected as before.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Call when a process has built what it keeps: its app, engine and pools (the bench client:
    before each measured run, so that one side's records are not walked during the next)."""
    gc.collect()
    gc.freeze()
