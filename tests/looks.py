"""Every path that looks at the jobs table, each as one call (issue 66): the API's submission
and its admission checks, GET /v1/jobs, the dispatcher's refill and fair share, the reaper, a
worker's lease renewal, retention's sweep, ``inferq status``, /metrics and the console's pages.
What runs per job or per look must read what is live, not the history: PostgreSQL's plans of
them are read in tests/integration/test_query_plans.py, SQLite's in
tests/unit/test_sqlite_plans.py, from this one list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.core.settings import Settings
from tests.unit.inprocess import call
from workers.inference.executor import Executor
from workers.inference.heartbeat import Heartbeat

CONSOLE_PAGES = (
    "/console",
    "/console/jobs",
    "/console/jobs?status=succeeded",
    "/console/tenants",
    "/console/jobs?q=no-such-text",
    "/console/jobs?tenant=t&q=no-such-text",
    "/console/jobs?status=succeeded&q=no-such-text",
)


def looks(settings: Settings, executor: Executor) -> dict[str, Callable[[], Any]]:
    """Each look by its name. ``executor``: a worker's, holding leases its heartbeat renews."""
    from app.cli import status
    from app.core.lifecycle import retention
    from app.core.messaging import clients
    from app.dispatcher import refill
    from workers.ops import reaper

    model = settings.model_name
    return {
        "submit": lambda: call("POST", "/v1/jobs", json={"model": model, "prompt": "one more"}),
        "GET /v1/jobs": lambda: call("GET", "/v1/jobs"),
        **{
            f"GET /v1/jobs?status={state}": (
                lambda state=state: call("GET", f"/v1/jobs?status={state}")
            )
            for state in ("queued", "failed")
        },
        "refill": lambda: refill.refill(
            refill.Route("bulk", model),
            64,
            policy="fair",
            unit=8,
            waited=set(),
            client=clients.redis_client(),
        ),
        "reaper": lambda: reaper.sweep(settings),
        "heartbeat": Heartbeat(executor, settings, {}).renew,
        "retention": lambda: retention.sweep(settings, budget_s=5),
        "inferq status": status.read_here,
        "GET /v1/admin/status": lambda: call("GET", "/v1/admin/status"),
        "/metrics": lambda: call("GET", "/metrics"),
        **{f"console {page}": (lambda page=page: call("GET", page)) for page in CONSOLE_PAGES},
    }
