"""/v1/jobs: submit, read, list and cancel jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from app.api.auth import Tenant, caller_limits
from app.api.deps import SessionDep
from app.api.schemas import (
    ErrorBody,
    JobBulkCreate,
    JobBulkOut,
    JobList,
    WebhookDeliveryList,
    WebhookDeliveryOut,
    WebhookEventOut,
)
from app.core.contract.jobs import JobCreate, JobOut
from app.core.lifecycle import deliveries, jobs, retention
from app.core.models import JobStatus, Lane
from app.core.scheduling import catalog
from app.core.settings import get_settings
from app.core.webhooks import outbox

router = APIRouter(prefix="/v1", tags=["jobs"], responses={"default": {"model": ErrorBody}})


@router.post("/jobs", status_code=202, response_model=JobOut)
def create_job(
    body: JobCreate,
    tenant: Tenant,
    session: SessionDep,
    request: Request,
    response: Response,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key")] = None,
) -> JobOut:
    """Submit a job. 202 means the job is committed and will reach a terminal state."""
    model = catalog.resolve(body.model)
    job, created = jobs.submit(
        session, tenant, body, model, caller_limits(request), idempotency_key
    )
    if not created:
        response.status_code = 200
    return JobOut.from_row(job)


@router.post("/jobs/bulk", status_code=202, response_model=JobBulkOut)
def create_jobs(
    body: JobBulkCreate, tenant: Tenant, session: SessionDep, request: Request
) -> JobBulkOut:
    """Submit many jobs at once: all are committed, or none (a 4xx names the bad one)."""
    models = [catalog.resolve(job.model) for job in body.jobs]
    rows = jobs.submit_many(session, tenant, body.jobs, models, caller_limits(request))
    return JobBulkOut(data=[JobOut.from_row(job) for job in rows])


@router.get("/jobs/{job_id}", response_model=JobOut)
def get_job(job_id: str, tenant: Tenant, session: SessionDep) -> JobOut:
    """Read one job."""
    return JobOut.from_row(jobs.get(session, tenant, job_id))


@router.get("/jobs", response_model=JobList)
def list_jobs(
    tenant: Tenant,
    session: SessionDep,
    status: JobStatus | None = None,
    lane: Lane | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
    after: str | None = None,
) -> JobList:
    """List jobs, newest first; pass the last id as `after` for the next page."""
    listed = jobs.list_page(session, tenant, status=status, lane=lane, limit=limit, after=after)
    history = retention.horizon(session, tenant)
    return JobList(
        data=[JobOut.from_row(r) for r in listed.rows],
        has_more=listed.has_more,
        retention_s=history.retention_s,
        expired_through=history.swept_through,
    )


@router.post("/jobs/{job_id}/cancel", response_model=JobOut)
def cancel_job(job_id: str, tenant: Tenant, session: SessionDep) -> JobOut:
    """Cancel a job: queued jobs never run, running jobs are aborted in the engine."""
    job, running = jobs.cancel(session, tenant, job_id)
    if running:
        job = jobs.wait_until_terminal(session, job, get_settings().cancel_wait_s)
    return JobOut.from_row(job)


@router.get("/jobs/{job_id}/webhook-deliveries", response_model=WebhookDeliveryList)
def list_webhook_deliveries(
    job_id: str, tenant: Tenant, session: SessionDep
) -> WebhookDeliveryList:
    """The job's webhook event (if any) and every delivery attempt made for it, oldest first."""
    job = jobs.get(session, tenant, job_id)
    event = outbox.job_event(session, job)
    if event is None:
        return WebhookDeliveryList(event=None, data=[])
    rows = outbox.attempts(session, event)
    return WebhookDeliveryList(
        event=WebhookEventOut.from_row(event),
        data=[WebhookDeliveryOut.from_row(a) for a in rows],
    )


@router.post(
    "/jobs/{job_id}/webhook-deliveries/redeliver", status_code=202, response_model=WebhookEventOut
)
def redeliver_webhook(job_id: str, tenant: Tenant, session: SessionDep) -> WebhookEventOut:
    """Send the job's event again (same webhook-id), with a fresh retry schedule."""
    job = jobs.get(session, tenant, job_id)
    return WebhookEventOut.from_row(deliveries.redeliver_job_event(session, job))
