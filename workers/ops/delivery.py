"""Webhook delivery on the ops worker: one attempt per message, every attempt recorded.

An attempt first claims the event: a compare-and-set that counts the attempt and moves
``next_attempt_at`` past the attempt's own timeout (the attempt's lease). A duplicate message,
or a sweep that raced the first announcement, finds nothing to claim. If the ops worker dies
mid-attempt, the lease runs out and the sweep sends the event again.

The HTTP request goes to the address that passed the URL policy at this very attempt (the
``Host`` header and TLS server name keep the URL's host), redirects are not followed, the
whole exchange must end with a 2xx within ``webhook_timeout_s``, and at most
``webhook_response_max_bytes`` of the answer are read. Failures are scheduled in the database
(``next_attempt_at``); beat's periodic :func:`sweep` sends whatever is due, so there are no
long Celery countdowns and a Redis restart loses no retry.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.batches.schemas import BatchOut
from app.core.contract.jobs import JobOut
from app.core.db import session_scope, with_db_retry
from app.core.messaging import broker
from app.core.models import (
    Batch,
    Job,
    WebhookAttempt,
    WebhookEndpoint,
    WebhookEvent,
    WebhookStatus,
    new_id,
    now,
)
from app.core.settings import Settings
from app.core.webhooks import endpoints, rules
from app.core.webhooks.outbox import SWEEP_BATCH
from workers import metrics

log = logging.getLogger("inferq.delivery")


# How far past its timeout an attempt's lease reaches before a sweep may send it again.
LEASE_MARGIN_S = 15.0
# An announced event nobody claimed this long after it was due is announced again (its
# message was lost, e.g. Redis was wiped).
REDISPATCH_S = 60.0


@dataclass(frozen=True)
class Claimed:
    event_id: str
    url: str
    body: str
    number: int  # attempts of this event so far, this one included
    round_number: int  # attempts in the current round of the schedule
    kind: str  # scheduled | redelivery
    secrets: list[str]  # the secrets that sign this attempt


@dataclass(frozen=True)
class Sent:
    ok: bool
    status_code: int | None = None
    error: str | None = None
    response_body: str | None = None
    latency_ms: float | None = None
    address: str | None = None


def _event_data(session: Session, job_id: str | None, batch_id: str | None) -> dict[str, Any]:
    """The ``data`` of an event: the job or batch exactly as the API returns it."""
    if job_id is not None:
        job = session.get(Job, job_id)
        if job is not None:
            return JobOut.from_row(job, vectors=False).model_dump(mode="json")
    if batch_id is not None:
        batch = session.get(Batch, batch_id)
        if batch is not None:
            return BatchOut.from_row(batch).model_dump(mode="json")
    return {"id": job_id or batch_id}


def deliver(event_id: str, settings: Settings) -> str:
    """Make one attempt to deliver an event; returns what became of it."""
    claimed = with_db_retry(lambda: _claim(event_id, settings), "webhook claim")
    if claimed is None:
        return "skipped"
    sent = send(claimed.url, claimed.event_id, claimed.body, settings, claimed.secrets)
    if not sent.ok:
        log.info("webhook %s attempt %d failed: %s", event_id, claimed.number, sent.error or "?")
    outcome = with_db_retry(lambda: _record(claimed, sent, settings), "webhook record")
    metrics.WEBHOOK_ATTEMPTS.labels(outcome).inc()
    return outcome


def _claim(event_id: str, settings: Settings) -> Claimed | None:
    stamp = now()
    with session_scope() as session:
        row = session.execute(
            update(WebhookEvent)
            .where(
                WebhookEvent.id == event_id,
                WebhookEvent.status == WebhookStatus.PENDING,
                WebhookEvent.next_attempt_at <= stamp,
            )
            .values(
                attempts=WebhookEvent.attempts + 1,
                round_attempts=WebhookEvent.round_attempts + 1,
                next_attempt_at=stamp + settings.webhook_timeout_s + LEASE_MARGIN_S,
                updated_at=stamp,
            )
            .returning(
                WebhookEvent.url,
                WebhookEvent.type,
                WebhookEvent.occurred_at,
                WebhookEvent.job_id,
                WebhookEvent.batch_id,
                WebhookEvent.endpoint_id,
                WebhookEvent.body,
                WebhookEvent.attempts,
                WebhookEvent.round_attempts,
            )
        ).first()
        if row is None:
            return None
        # A registered endpoint's event (its OpenAI body written with it,
        # app/core/webhooks/outbox.py) is signed with the endpoint's secrets as they are now: a
        # rotation applies to the retries. Else inferq's body and the deployment's secrets.
        endpoint = (
            session.get(WebhookEndpoint, row.endpoint_id) if row.endpoint_id is not None else None
        )
        body = row.body
        if body is None:
            # Rendered once, at the first attempt: every retry sends the same bytes.
            data = _event_data(session, row.job_id, row.batch_id)
            body = rules.render(row.type, row.occurred_at, data)
            session.execute(
                update(WebhookEvent).where(WebhookEvent.id == event_id).values(body=body)
            )
        signing = (
            endpoints.signing_secrets(endpoint, stamp)
            if endpoint is not None
            else rules.signing_secrets(settings)
        )
    kind = "redelivery" if row.round_attempts == 1 and row.attempts > 1 else "scheduled"
    # An endpoint's events go where it points now: a tenant that moves it moves its retries.
    url = endpoint.url if endpoint is not None else row.url
    return Claimed(event_id, url, body, row.attempts, row.round_attempts, kind, signing)


def send(url: str, event_id: str, body: str, settings: Settings, secrets: list[str]) -> Sent:
    """One HTTP attempt under one deadline for everything (DNS included), signed with each of
    ``secrets``; never raises."""
    start = time.monotonic()
    try:
        return asyncio.run(_send(url, event_id, body, settings, secrets, start))
    except Exception as exc:  # a URL httpx cannot build, or anything else unforeseen
        log.exception("webhook %s: the attempt could not be made", event_id)
        latency = (time.monotonic() - start) * 1000
        return Sent(False, error=f"{type(exc).__name__}: {exc}", latency_ms=latency)


async def _send(
    url: str, event_id: str, body: str, settings: Settings, secrets: list[str], start: float
) -> Sent:
    limit = settings.webhook_timeout_s
    address: str | None = None
    try:
        async with asyncio.timeout(limit):
            try:
                # Resolved again now: what was checked at submit time may point elsewhere today.
                target = await asyncio.to_thread(
                    rules.check_url, url, settings.webhook_allow_private
                )
            except rules.WebhookUrlError as exc:
                return Sent(False, error=f"refused: {exc}")
            headers = rules.signed_headers(event_id, body, time.time(), secrets)
            headers["accept-encoding"] = "identity"  # the recorded bytes are the bytes read
            parsed = httpx.URL(url)
            headers["host"] = parsed.netloc.decode("ascii")  # IDNA-encoded by httpx
            sni = parsed.raw_host.decode("ascii")
            extensions = {"sni_hostname": sni} if target.scheme == "https" else {}
            # No proxy from the environment (it would undo the pinning), no redirects.
            async with httpx.AsyncClient(
                verify=_tls(), follow_redirects=False, trust_env=False
            ) as client:
                for i, ip in enumerate(target.addresses):
                    address = str(ip)
                    request = client.build_request(
                        "POST",
                        parsed.copy_with(host=address),
                        content=body.encode(),
                        headers=headers,
                        extensions=extensions,
                    )
                    try:
                        response = await client.send(request, stream=True)
                    except httpx.ConnectError:
                        if i + 1 < len(target.addresses):
                            continue  # e.g. an IPv6 address this host cannot reach
                        raise
                    code = response.status_code
                    try:
                        text = await _read_capped(response, settings.webhook_response_max_bytes)
                    finally:
                        await response.aclose()
                    break
    except TimeoutError:
        return Sent(False, error="timeout", latency_ms=limit * 1000, address=address)
    except httpx.HTTPError as exc:
        latency = (time.monotonic() - start) * 1000
        return Sent(
            False, error=f"{type(exc).__name__}: {exc}", latency_ms=latency, address=address
        )
    latency = (time.monotonic() - start) * 1000
    if 200 <= code < 300:
        return Sent(True, code, None, text, latency, address)
    error = f"HTTP {code}" + (" (redirects are not followed)" if 300 <= code < 400 else "")
    return Sent(False, code, error, text, latency, address)


@functools.cache
def _tls() -> ssl.SSLContext:
    # Building the context (loading the CA bundle) costs ~20 ms; an attempt needs ~1 ms more.
    return httpx.create_ssl_context()


async def _read_capped(response: httpx.Response, cap: int) -> str:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk)
        size += len(chunk)
        if size >= cap:
            break
    return b"".join(chunks)[:cap].decode("utf-8", errors="replace")


def _record(claimed: Claimed, sent: Sent, settings: Settings) -> str:
    stamp = now()
    values: dict[str, float | None]
    if sent.ok:
        outcome, values = WebhookStatus.DELIVERED, {"next_attempt_at": None}
    else:
        delay = rules.retry_delay(settings, claimed.round_number)
        if delay is None:
            outcome, values = WebhookStatus.FAILED, {"next_attempt_at": None}
        else:
            outcome, values = WebhookStatus.PENDING, {"next_attempt_at": stamp + delay}
    try:
        _write_attempt(claimed, sent, stamp, outcome, values)
    except IntegrityError:
        # The event was removed with its endpoint during the attempt: no log to write to.
        return "skipped"
    return "delivered" if sent.ok else ("failed" if outcome == WebhookStatus.FAILED else "retry")


def _write_attempt(
    claimed: Claimed, sent: Sent, stamp: float, outcome: str, values: dict[str, float | None]
) -> None:
    """The attempt in the event's log, and its outcome on the event."""
    with session_scope() as session:
        session.add(
            WebhookAttempt(
                id=new_id("wha"),
                event_id=claimed.event_id,
                number=claimed.number,
                kind=claimed.kind,
                url=claimed.url,
                address=sent.address,
                started_at=stamp - (sent.latency_ms or 0) / 1000,
                latency_ms=sent.latency_ms,
                status_code=sent.status_code,
                ok=sent.ok,
                error=sent.error,
                response_body=sent.response_body,
            )
        )
        # Fenced by the attempt number: a newer attempt (this one's lease ran out) decides.
        session.execute(
            update(WebhookEvent)
            .where(
                WebhookEvent.id == claimed.event_id,
                WebhookEvent.attempts == claimed.number,
                WebhookEvent.status == WebhookStatus.PENDING,
            )
            .values(status=outcome, updated_at=stamp, **values)
        )


def sweep() -> int:
    """Announce due events that have no message on their way; returns how many.

    The events are marked as announced in one short transaction (on PostgreSQL, rows another
    ops worker's sweep holds are skipped), and only then sent, so no lock is held while the
    broker is talked to; the ones that could not be sent are unmarked again.
    """
    stamp = now()
    with session_scope() as session:
        query = (
            select(WebhookEvent.id)
            .where(
                WebhookEvent.status == WebhookStatus.PENDING,
                WebhookEvent.next_attempt_at <= stamp,
                or_(
                    WebhookEvent.dispatched_at.is_(None),
                    WebhookEvent.dispatched_at < WebhookEvent.next_attempt_at,
                    WebhookEvent.dispatched_at < stamp - REDISPATCH_S,
                ),
            )
            .order_by(WebhookEvent.next_attempt_at)
            .limit(SWEEP_BATCH)
        )
        if session.get_bind().dialect.name == "postgresql":
            query = query.with_for_update(skip_locked=True)
        ids = list(session.scalars(query))
        if ids:
            session.execute(
                update(WebhookEvent).where(WebhookEvent.id.in_(ids)).values(dispatched_at=stamp)
            )
    if not ids:
        return 0
    failed = broker.send_webhooks(ids)
    if failed:
        with session_scope() as session:
            session.execute(
                update(WebhookEvent)
                .where(WebhookEvent.id.in_(failed), WebhookEvent.dispatched_at == stamp)
                .values(dispatched_at=None)
            )
    return len(ids) - len(failed)
