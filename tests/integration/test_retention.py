"""Retention (issue 66; app/core/lifecycle/retention.py): finished jobs past their tenant's
retention are deleted by the ops worker's sweep, a deleted job answers 404 ``job_expired``, a
list says where history ends, and nothing still owed (a batch's output, a webhook's retries) is
swept before its own end. In process, on SQLite and on PostgreSQL: the API's routes, the
sweep as the ops worker runs it, and no inference worker (jobs end by being cancelled). The
sweep is run at a moment past the retention (``stamp``) instead of waiting 30 days.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pydantic import ValidationError
from sqlalchemy import select, text, update

from app.batches import finalize, validation
from app.cli.main import main as cli
from app.core import db
from app.core.lifecycle import retention
from app.core.models import Job, WebhookEvent, WebhookStatus, now
from app.core.settings import MAX_RETENTION_S, Settings
from app.core.tenants.keys import create_key
from tests.unit.conftest import environment
from tests.unit.inprocess import call, create_batch

DAY = 86400.0
LATER = 31 * DAY  # past the default retention of 30 days


@pytest.fixture
def core(migrated_settings: Settings) -> Iterator[Settings]:
    with environment(require_auth="false", webhook_allow_private="true") as settings:
        yield settings


def submit(core: Settings, **body: Any) -> str:
    made = call("POST", "/v1/jobs", json={"model": core.model_name, "prompt": "hi", **body})
    assert made.status_code == 202, made.text
    return str(made.json()["id"])


def cancel(job_id: str) -> None:
    done = call("POST", f"/v1/jobs/{job_id}/cancel")
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "cancelled", done.text


def left(ids: list[str]) -> set[str]:
    with db.session_scope() as session:
        return set(session.scalars(select(Job.id).where(Job.id.in_(ids))))


def test_a_finished_job_past_retention_is_deleted_and_answers_expired(core: Settings) -> None:
    finished = [submit(core) for _ in range(3)]
    for job_id in finished:
        cancel(job_id)
    queued = submit(core)
    assert retention.sweep(core, budget_s=30, stamp=now() + DAY) == 0  # not yet due
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 3
    assert left([*finished, queued]) == {queued}  # a job not ended is never swept

    gone = call("GET", f"/v1/jobs/{finished[0]}")
    assert gone.status_code == 404, gone.text
    error = gone.json()["error"]
    assert error["code"] == "job_expired"
    assert "has expired" in error["message"] and "30 days" in error["message"]
    assert call("GET", f"/v1/jobs/{queued}").status_code == 200
    # An id newer than anything deleted is not called expired, nor is a malformed one.
    never = "job_" + "z" * 26
    assert call("GET", f"/v1/jobs/{never}").json()["error"]["code"] == "job_not_found"
    assert call("GET", "/v1/jobs/job_nope").json()["error"]["code"] == "job_not_found"

    page = call("GET", "/v1/jobs").json()
    assert [job["id"] for job in page["data"]] == [queued]
    assert page["retention_s"] == 30 * 86400
    assert page["expired_through"] == max(finished)


def test_the_sweep_goes_on_chunk_by_chunk(core: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retention, "CHUNK", 2)
    monkeypatch.setattr(retention, "SQLITE_CHUNK", 2)
    ids = [submit(core) for _ in range(5)]
    for job_id in ids:
        cancel(job_id)
    assert retention.sweep_once(core, now() + LATER) == 2  # one transaction, one chunk
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 3
    assert left(ids) == set()


def test_the_sweep_keeps_to_its_pace_and_its_budget(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retention, "CHUNK", 2)
    monkeypatch.setattr(retention, "SQLITE_CHUNK", 2)
    ids = [submit(core) for _ in range(9)]
    for job_id in ids:
        cancel(job_id)
    paced = core.model_copy(update={"retention_sweep_jobs_per_s": 10})
    # 10 jobs a second: after the chunk that deleted its fourth job it would wait until 0.4 s;
    # its budget of 0.35 s has passed by then, and the next sweep goes on.
    assert retention.sweep(paced, budget_s=0.35, stamp=now() + LATER) == 4
    started = time.monotonic()
    assert retention.sweep(paced, budget_s=30, stamp=now() + LATER) == 5
    assert time.monotonic() - started >= 4 / 10  # two full chunks of two: 0.4 s at least
    assert left(ids) == set()


def test_a_tenant_keeps_its_own_retention(core: Settings) -> None:
    kept = submit(core)
    cancel(kept)
    shown = CliRunner().invoke(cli, ["tenant", "retention", "default", "--days", "0"])
    assert shown.exit_code == 0, shown.output
    assert "kept forever" in shown.output
    assert retention.sweep(core, budget_s=30, stamp=now() + 10 * LATER) == 0
    assert call("GET", "/v1/jobs").json()["retention_s"] is None

    shown = CliRunner().invoke(cli, ["tenant", "retention", "default", "--days", "2"])
    assert "2 days" in shown.output, shown.output
    assert retention.sweep(core, budget_s=30, stamp=now() + DAY) == 0
    assert retention.sweep(core, budget_s=30, stamp=now() + 3 * DAY) == 1
    assert "2 days" in call("GET", f"/v1/jobs/{kept}").json()["error"]["message"]

    shown = CliRunner().invoke(cli, ["tenant", "retention", "default", "--default"])
    assert "30 days" in shown.output and kept in shown.output, shown.output

    # Past ten years (the column's seconds) is refused, and the retention stays as it was.
    shown = CliRunner().invoke(cli, ["tenant", "retention", "default", "--days", "5000"])
    assert shown.exit_code == 1 and "retention_out_of_range" in shown.output, shown.output
    assert call("GET", "/v1/jobs").json()["retention_s"] == 30 * 86400


def test_a_deployment_retention_past_ten_years_refuses_to_start(tmp_path: Path) -> None:
    """The deployment's retention has a tenant's bound (it is never stored, but a tenant that
    follows the default shows it, and one rule for both is simpler to say)."""
    assert Settings(data_dir=tmp_path, job_retention_s=MAX_RETENTION_S).job_retention_s > 0
    with pytest.raises(ValidationError, match="job_retention_s"):
        Settings(data_dir=tmp_path, job_retention_s=MAX_RETENTION_S + 1)


def test_an_operator_sets_a_tenants_retention_through_the_admin_api(
    migrated_settings: Settings,
) -> None:
    with environment(require_auth="true") as settings, db.session_scope() as session:
        _, acme = create_key(session, "acme")
        _, ops = create_key(session, "ops", operator=True)
    as_acme = {"Authorization": f"Bearer {acme}"}
    as_ops = {"Authorization": f"Bearer {ops}"}
    with environment(require_auth="true") as settings:
        made = call(
            "POST", "/v1/jobs", headers=as_acme, json={"model": settings.model_name, "prompt": "x"}
        )
        job_id = made.json()["id"]
        assert call("POST", f"/v1/jobs/{job_id}/cancel", headers=as_acme).status_code == 200

        # A tenant's own key may not: the route is the operator's.
        refused = call(
            "POST", "/v1/admin/tenants/acme", headers=as_acme, json={"job_retention_s": 0}
        )
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "operator_key_required"
        assert call("GET", "/v1/admin/tenants/acme", headers=as_acme).status_code == 403

        shown = call("GET", "/v1/admin/tenants/acme", headers=as_ops).json()
        assert shown == {
            "id": "acme",
            "object": "tenant",
            "job_retention_s": None,
            "retention_s": 30 * 86400,
            "expired_through": None,
            "swept_at": None,
        }
        # Bad values are refused and change nothing: below 0, past the longest, not given.
        for body in ({"job_retention_s": -1}, {"job_retention_s": 10**12}, {}, {"days": 1}):
            bad = call("POST", "/v1/admin/tenants/acme", headers=as_ops, json=body)
            assert bad.status_code == 422, (body, bad.text)
        for name in ("a" * 65, "a%00b"):
            bad = call("GET", f"/v1/admin/tenants/{name}", headers=as_ops)
            assert bad.status_code == 422, (name, bad.text)
        assert call("GET", "/v1/admin/tenants/acme", headers=as_ops).json() == shown

        day = call(
            "POST", "/v1/admin/tenants/acme", headers=as_ops, json={"job_retention_s": 86400}
        )
        assert day.status_code == 200, day.text
        assert day.json()["job_retention_s"] == day.json()["retention_s"] == 86400
        assert retention.sweep(settings, budget_s=30, stamp=now() + DAY / 2) == 0
        assert retention.sweep(settings, budget_s=30, stamp=now() + 2 * DAY) == 1
        after = call("GET", "/v1/admin/tenants/acme", headers=as_ops).json()
        assert after["expired_through"] == job_id and after["swept_at"] is not None
        gone = call("GET", f"/v1/jobs/{job_id}", headers=as_acme).json()["error"]
        assert gone["code"] == "job_expired" and "1 days" in gone["message"], gone

        back = call(
            "POST", "/v1/admin/tenants/acme", headers=as_ops, json={"job_retention_s": None}
        )
        assert back.json()["job_retention_s"] is None
        assert back.json()["retention_s"] == 30 * 86400


def test_a_pending_webhook_keeps_its_job_until_it_is_delivered(core: Settings) -> None:
    owed = submit(core, webhook_url="http://127.0.0.1:9/hook")
    cancel(owed)
    with db.session_scope() as session:
        events = session.scalars(select(WebhookEvent).where(WebhookEvent.job_id == owed)).all()
        assert [e.status for e in events] == [WebhookStatus.PENDING]
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 0
    with db.transaction() as connection:  # the delivery ended: its last attempt failed
        connection.execute(
            update(WebhookEvent)
            .where(WebhookEvent.job_id == owed)
            .values(status=WebhookStatus.FAILED)
        )
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 1
    with db.session_scope() as session:  # its events went with it
        assert session.scalar(select(WebhookEvent.id).where(WebhookEvent.job_id == owed)) is None


def test_a_batch_keeps_its_jobs_while_its_output_is_kept(core: Settings) -> None:
    lines = [
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": core.model_name,
                    "max_tokens": 2,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                },
            }
        ).encode()
        for i in range(3)
    ]
    batch_id = create_batch(lines, "/v1/chat/completions")
    validation.start(batch_id)
    with db.session_scope() as session:
        ids = list(session.scalars(select(Job.id).where(Job.batch_id == batch_id)))
    assert len(ids) == 3
    assert call("POST", f"/v1/batches/{batch_id}/cancel").status_code == 200
    # Cancelled lines have ended, but the batch has not: its output is still to be written.
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 0
    assert finalize.finalize(batch_id)
    batch = call("GET", f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "cancelled", batch
    files = [f for f in (batch["output_file_id"], batch["error_file_id"]) if f]
    assert files, batch
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 0
    for file_id in files:  # as files.delete_expired does when the output file expires
        assert call("DELETE", f"/v1/files/{file_id}").status_code == 200
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 3
    assert left(ids) == set()


def test_a_stored_response_past_retention_answers_expired(core: Settings) -> None:
    made = call(
        "POST",
        "/v1/responses",
        json={"model": core.model_name, "input": "hi", "background": True},
    )
    assert made.status_code == 200, made.text
    response_id = made.json()["id"]
    assert call("POST", f"/v1/responses/{response_id}/cancel").status_code == 200
    assert retention.sweep(core, budget_s=30, stamp=now() + LATER) == 1
    gone = call("GET", f"/v1/responses/{response_id}")
    assert gone.status_code == 404, gone.text
    assert gone.json()["error"]["code"] == "response_expired"


def test_the_sweep_skips_a_row_another_transaction_holds(core: Settings) -> None:
    if not core.database_url.startswith("postgresql"):
        pytest.skip("SQLite has one writer at a time: no row is held by another transaction")
    held, free = submit(core), submit(core)
    cancel(held)
    cancel(free)
    locked = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with db.transaction() as connection:
            connection.execute(text("SELECT id FROM jobs WHERE id = :id FOR UPDATE"), {"id": held})
            locked.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert locked.wait(10)
        # Not waited for: the held row is skipped, the other deleted.
        assert retention.sweep_once(core, now() + LATER) == 1
        assert left([held, free]) == {held}
    finally:
        release.set()
        holder.join(10)
    assert retention.sweep_once(core, now() + LATER) == 1
