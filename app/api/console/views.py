"""What each console page shows, read through the services the API reads through.

Jobs, batches and files come from their services (app/core/lifecycle/jobs.py,
app/batches/service.py, app/core/storage/files.py) scoped to the viewer (``Viewer.scope``: the
operator reads every tenant's); lanes, workers, throughput and tenants from
app/core/observe/snapshot.py (what `inferq status` and /metrics read), fair share weights from
app/core/scheduling/fairshare.py, missing parts from app/core/observe/missing.py. Nothing here
writes: the actions are the routes', through the same calls as /v1 (app/api/console/routes.py).

The pictures (a chart, a timeline, a progress bar) are SVG shapes whose sizes are computed
here, so the pages need no script and no inline style to draw them (the console's
Content-Security-Policy allows neither: docs/console.md).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.api.console.sessions import Viewer
from app.batches import service as batches
from app.core.contract.pooling import unpack
from app.core.lifecycle import jobs
from app.core.messaging import clients
from app.core.messaging.names import routes
from app.core.models import TERMINAL, ApiKey, Batch, Job, JobKind, JobStatus
from app.core.observe import missing, shapes, snapshot
from app.core.processes import presence
from app.core.scheduling import catalog, fairshare
from app.core.scheduling.limits import for_key, window_usage
from app.core.settings import LANES, get_settings
from app.core.webhooks import outbox

PAGE = 25  # rows of a jobs or batches page
PREVIEW_ROWS, PREVIEW_VALUES = 4, 8  # of a pooled job's output on its page
CHART_MINUTES = 15
TENANT_WINDOW_S = 3600.0  # the tenants page's share of tokens: the last hour
# Lane colours of the chart and the tables (console.css has the same classes).
LANE_CLASS = {lane: f"lane-{lane}" for lane in LANES}
# A job's or a batch line's status, as the progress bars colour it.
STATUS_ORDER = ["succeeded", "failed", "cancelled", "expired", "running", "queued"]


def stamp(at: float | None) -> str:
    """A unix time as the console shows it (UTC, to the second); "" for none."""
    if at is None:
        return ""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


def clock(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S UTC")


@dataclass(frozen=True)
class Bar:
    """One rectangle of an SVG picture (x, y, width, height in the picture's units)."""

    x: float
    y: float
    width: float
    height: float
    css: str
    title: str


# --- overview -------------------------------------------------------------------------------


def overview(session: Session, viewer: Viewer, now: float) -> dict[str, Any]:
    """Per model and lane: waiting, running and the drain estimate; the last 15 minutes'
    throughput; the live parts and what is missing."""
    client = clients.redis_client()
    models = catalog.names()
    rows: list[dict[str, Any]] = []
    drains = snapshot.drain_estimates(client)
    if viewer.operator:
        for (lane, model), counts in snapshot.lane_jobs(session, now, models).items():
            rows.append(
                {
                    "model": model,
                    "lane": lane,
                    "queued": counts.queued,
                    "running": counts.running,
                    "oldest_s": round(counts.oldest_queued_age_s, 1),
                    "drain_s": drains.get((lane, model)),
                }
            )
    else:
        mine = {
            (lane, model): counts
            for (lane, model, tenant), counts in snapshot.tenant_jobs(session, now).items()
            if tenant == viewer.tenant
        }
        for lane, model in routes(models, mine):
            own = mine.get((lane, model))
            rows.append(
                {
                    "model": model,
                    "lane": lane,
                    "queued": own.queued if own else 0,
                    "running": own.running if own else 0,
                    "oldest_s": None,
                    "drain_s": drains.get((lane, model)),
                }
            )
    series = snapshot.finished_per_minute(session, now, CHART_MINUTES, viewer.scope)
    return {
        "rows": rows,
        "chart": throughput_chart(series),
        "finished": sum(sum(lanes.values()) for _, lanes in series),
        "parts": parts(client),
        "missing": [m.message() for m in missing.find(session, client, get_settings())],
        "as_of": clock(now),
    }


def throughput_chart(series: list[tuple[float, dict[str, int]]]) -> dict[str, Any]:
    """Stacked bars, one a minute, lanes in priority order from the bottom; 300 x 100 units."""
    width, height = 300.0, 100.0
    top = max([sum(lanes.values()) for _, lanes in series] + [1])
    step = width / max(1, len(series))
    bars: list[Bar] = []
    for i, (minute, lanes) in enumerate(series):
        y = height
        for lane in LANES:
            n = lanes.get(lane, 0)
            if not n:
                continue
            h = height * n / top
            y -= h
            title = f"{clock(minute)}: {n} {lane} job{'s' if n != 1 else ''} finished"
            bars.append(Bar(i * step + 1, y, step - 2, h, LANE_CLASS[lane], title))
    return {"bars": bars, "top": top, "width": width, "height": height, "lanes": LANES}


def parts(client: redis.Redis) -> dict[str, Any]:
    """The live processes (their presence records) and this API process; each worker with its
    prefix-cache hit rate and its prefix-affinity counts (docs/scheduling.md, "Prefix affinity")."""
    routed = snapshot.affinity_counts(client)
    workers = [
        {
            "id": w.get("worker_id"),
            "model": w.get("model"),
            "engine": w.get("engine"),
            "in_flight": w.get("in_flight", 0),
            "slots": (w.get("intake") or {}).get("slots"),
            # CUDA_VISIBLE_DEVICES as the worker saw it (None: every GPU, or none)
            "gpu": w.get("devices") or "",
            "cache_hits": shapes.prefix_hit_rate(w),
            "affinity": routed.get(str(w.get("worker_id"))),
        }
        for w in presence.workers(client)
    ]
    return {
        "api": f"{socket.gethostname()} (pid {os.getpid()})",
        "workers": workers,
        "ops": [o.get("worker_id") for o in presence.ops_workers(client)],
        "dispatchers": [d.get("worker_id") for d in presence.dispatchers(client)],
    }


# --- jobs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobFilters:
    status: str | None = None
    lane: str | None = None
    model: str | None = None
    tenant: str | None = None  # the operator's filter
    batch: str | None = None
    q: str | None = None
    after: str | None = None

    def query(self, **changes: str | None) -> dict[str, str]:
        """These filters (with ``changes``) as a URL's query, empty ones left out."""
        values = {**self.__dict__, **changes}
        return {k: v for k, v in values.items() if v}


def jobs_page(session: Session, viewer: Viewer, filters: JobFilters, now: float) -> dict[str, Any]:
    scope = viewer.scope if not viewer.operator else filters.tenant
    listed = jobs.list_page(
        session,
        scope,
        status=filters.status,
        lane=filters.lane,
        limit=PAGE,
        after=filters.after,
        model=filters.model,
        batch_id=filters.batch,
        search=filters.q,
    )
    rows = listed.rows
    return {
        "jobs": [job_row(j) for j in rows],
        "next": filters.query(after=rows[-1].id) if listed.has_more and rows else None,
        # A search read its window without filling the page: the next window, older.
        "older": filters.query(after=listed.searched_to) if listed.searched_to else None,
        "window": get_settings().console_search_window,
        "filters": filters,
        "statuses": [s.value for s in JobStatus],
        "lanes": LANES,
        "models": catalog.names(),
        "as_of": clock(now),
    }


def job_row(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "tenant": job.tenant,
        "status": job.status,
        "lane": job.lane,
        "model": job.model,
        "created": stamp(job.created_at),
        "finished": stamp(job.finished_at),
        "batch": job.batch_id,
        "tokens": (job.prompt_tokens or 0) + (job.completion_tokens or 0),
        "kind": job.kind,
    }


def pooled_preview(job: Job) -> dict[str, Any] | None:
    """A pooled job's output as the page shows it: how many rows, and the first few values of
    the first rows (a job's vectors can be megabytes: GET /v1/jobs/{id} has them whole)."""
    if job.pooled is None or not job.pooled_width:
        return None
    rows = unpack(job.pooled[: 4 * job.pooled_width * PREVIEW_ROWS], job.pooled_width)
    shown = [
        "["
        + ", ".join(f"{v:.4f}" for v in row[:PREVIEW_VALUES])
        + (", …]" if len(row) > PREVIEW_VALUES else "]")
        for row in rows
    ]
    count = len(job.pooled) // (4 * job.pooled_width)
    more = [f"… {count - len(rows)} more"] if count > len(rows) else []
    return {
        "rows": count,
        "width": job.pooled_width,
        "what": "scores" if job.kind == JobKind.SCORE else "vectors",
        "preview": "\n".join(shown + more),
    }


def job_page(session: Session, viewer: Viewer, job_id: str, now: float) -> dict[str, Any]:
    job = jobs.get(session, viewer.scope, job_id)
    event = outbox.job_event(session, job)
    attempts = outbox.attempts(session, event) if event is not None else []
    return {
        "job": job,
        "row": job_row(job),
        "pooled": pooled_preview(job),
        "timeline": timeline(job, now),
        "params": job.params,
        "deliveries": [
            {
                "number": a.number,
                "kind": a.kind,
                "started": stamp(a.started_at),
                "status_code": a.status_code,
                "ok": a.ok,
                "error": a.error or "",
                "latency_ms": None if a.latency_ms is None else round(a.latency_ms, 1),
            }
            for a in attempts
        ],
        "event": event,
        "cancellable": job.status not in TERMINAL,
        "redeliverable": job.webhook_url is not None and job.status in TERMINAL,
        "as_of": clock(now),
    }


def timeline(job: Job, now: float) -> dict[str, Any]:
    """queued -> claimed -> first token -> finished as segments of a 600-unit bar, and the
    moments with their times (a step not reached yet ends at ``now``)."""
    marks = [
        ("created", job.created_at),
        ("claimed", job.started_at),
        ("first token", job.first_token_at),
        ("finished", job.finished_at),
    ]
    end = job.finished_at or now
    span = max(end - job.created_at, 1e-3)
    width = 600.0
    segments: list[Bar] = []
    names = ["waiting", "prefill", "generating"]
    for (_, start), (_, stop), name in zip(marks, marks[1:], names, strict=False):
        if start is None:
            break
        until = stop if stop is not None else end  # a step not reached: up to now, or the end
        x = width * (start - job.created_at) / span
        w = max(1.0, width * (until - start) / span)
        segments.append(Bar(x, 0, w, 24, f"seg-{name}", f"{name}: {until - start:.3f} s"))
    return {
        "segments": segments,
        "marks": [
            {"name": name, "at": stamp(at), "after_s": None if at is None else at - job.created_at}
            for name, at in marks
        ],
        "attempts": job.attempts,
        "width": width,
    }


# --- batches ----------------------------------------------------------------------------------


def batches_page(session: Session, viewer: Viewer, after: str | None, now: float) -> dict[str, Any]:
    rows, has_more = batches.list_page(session, viewer.scope, limit=PAGE, after=after)
    return {
        "batches": [batch_row(session, b) for b in rows],
        "next": rows[-1].id if has_more and rows else None,
        "as_of": clock(now),
    }


def batch_row(session: Session, batch: Batch) -> dict[str, Any]:
    by_status = batches.lines_by_status(session, batch.id)
    counts = batches.counts(session, batch, by_status)
    total = max(counts.total, sum(by_status.values()), 1)
    width, x = 300.0, 0.0
    bars: list[Bar] = []
    for status in STATUS_ORDER:
        n = by_status.get(status, 0)
        if n:
            w = width * n / total
            bars.append(Bar(x, 0, w, 14, f"st-{status}", f"{n} {status}"))
            x += w
    return {
        "id": batch.id,
        "tenant": batch.tenant,
        "status": batch.status,
        "endpoint": batch.endpoint,
        "counts": counts,
        "by_status": by_status,
        "bars": bars,
        "width": width,
        "created": stamp(batch.created_at),
        "started": stamp(batch.in_progress_at),
        "finished": stamp(
            batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at
        ),
        "files": [
            (name, file_id)
            for name, file_id in (
                ("input", batch.input_file_id),
                ("output", batch.output_file_id),
                ("errors", batch.error_file_id),
            )
            if file_id
        ],
        "cancellable": batch.status in ("validating", "in_progress"),
    }


# --- tenants (the operator's) -----------------------------------------------------------------


def tenants_page(session: Session, now: float) -> dict[str, Any]:
    """Each tenant's weight, its share of the tokens served in the last hour against its share
    of the weights (the fair share made visible: docs/scheduling.md, "Fair share"), its limits
    with what it has used of them in the window going on, and what it has queued and running
    now."""
    weights = fairshare.weights(session)
    served: dict[str, int] = {}
    queued: dict[str, int] = {}
    running: dict[str, int] = {}
    for (_, _, tenant), counts in snapshot.tenant_jobs(session, now, TENANT_WINDOW_S).items():
        served[tenant] = served.get(tenant, 0) + counts.tokens_served
        queued[tenant] = queued.get(tenant, 0) + counts.queued
        running[tenant] = running.get(tenant, 0) + counts.running
    keys = session.execute(
        select(
            ApiKey.tenant,
            func.count(),
            func.min(ApiKey.requests_per_minute),
            func.min(ApiKey.tokens_per_minute),
            func.min(ApiKey.max_queued),
        )
        .where(ApiKey.revoked_at.is_(None))
        .group_by(ApiKey.tenant)
    ).all()
    limits = {tenant: (n, for_key(rpm, tpm, mq)) for tenant, n, rpm, tpm, mq in keys}
    names = sorted(set(weights) | set(served) | set(queued) | set(limits))
    total_served = sum(served.values()) or 1
    # A tenant's fair share is its weight among the tenants that were served or wait now.
    active = [t for t in names if served.get(t) or queued.get(t) or running.get(t)]
    total_weight = sum(weights.get(t, 1.0) for t in active) or 1.0
    used = window_usage(names)
    rows = []
    for tenant in names:
        key_count, lim = limits.get(tenant, (0, for_key(None, None, None)))
        share = served.get(tenant, 0) / total_served
        fair = weights.get(tenant, 1.0) / total_weight if tenant in active else 0.0
        rows.append(
            {
                "tenant": tenant,
                "weight": weights.get(tenant, 1.0),
                "key_count": key_count,
                "served": served.get(tenant, 0),
                "share": share,
                "fair": fair,
                "bars": [
                    Bar(0, 0, 200 * share, 8, "share-served", f"served {share:.0%}"),
                    Bar(0, 10, 200 * fair, 8, "share-fair", f"weight's share {fair:.0%}"),
                ],
                "rpm": lim.requests_per_minute,
                "tpm": lim.tokens_per_minute,
                "requests_now": used[tenant][0],
                "tokens_now": used[tenant][1],
                "max_queued": lim.max_queued,
                "queued": queued.get(tenant, 0),
                "running": running.get(tenant, 0),
            }
        )
    return {
        "tenants": rows,
        "window_h": TENANT_WINDOW_S / 3600,
        "limit_window_s": get_settings().limit_window_s,
        "as_of": clock(now),
    }
