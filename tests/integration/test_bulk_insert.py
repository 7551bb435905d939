"""New jobs by the chunk: PostgreSQL's COPY writes what an INSERT writes (``db.copy_rows``,
used by ``transitions.create`` for more than one job), on a real server; SQLite inserts."""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import pytest
from sqlalchemy import Table, insert, select
from sqlalchemy.exc import IntegrityError

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.after import After, Tx
from app.core.models import Job, NewJob, new_id
from app.core.settings import Settings

TABLE = cast(Table, Job.__table__)


@pytest.fixture
def settings(migrated_settings: Settings) -> Settings:
    """On SQLite, then on PostgreSQL (tests/integration/conftest.py)."""
    return migrated_settings


BODIES: list[dict[str, Any]] = [
    {"prompt": "plain", "lane": "bulk"},
    {"prompt": "a NUL \x00 and U+FFFF \uffff in a prompt", "metadata": {"k\x00": "v\uffff"}},
    {
        "messages": [{"role": "user", "content": "tab\t, newline\n, backslash \\ and \x00"}],
        "params": {"max_tokens": 3, "stop": ["\x00"], "temperature": 0.5},
        "timeout_s": 30,
        "user": "someone \x00",
    },
    {"prompt": [1, 2, 3], "params": {"n": 2}},
    {"prompt": ["one", "two\x00"], "webhook_url": "https://8.8.8.8/hook"},
]


def made(settings: Settings) -> list[NewJob]:
    return [
        jobs.new_job("t", JobCreate.model_validate(body), settings.model_name) for body in BODIES
    ]


def stored(ids: list[str]) -> list[dict[str, Any]]:
    with db.transaction() as connection:
        rows = connection.execute(select(TABLE).where(Job.id.in_(ids))).mappings().all()
    order = {job_id: i for i, job_id in enumerate(ids)}
    return [
        {k: v for k, v in row.items() if k != "id"}
        for row in sorted(rows, key=lambda r: order[r["id"]])
    ]


def test_a_chunk_of_jobs_is_stored_as_an_insert_stores_it(settings: Settings) -> None:
    by_insert = made(settings)
    by_create = [dataclasses.replace(job, id=new_id("job")) for job in by_insert]
    with db.transaction() as connection:
        connection.execute(insert(TABLE), [job.row() for job in by_insert])  # the ORM's INSERT
        transitions.create(Tx(connection, After("api")), by_create)  # PostgreSQL: COPY
    inserted = stored([job.id for job in by_insert])
    created = stored([job.id for job in by_create])
    assert len(created) == len(BODIES)
    assert created == inserted
    # What the escapes must give back, byte for byte (app/core/models.py, ESCAPE).
    assert created[1]["prompt"] == BODIES[1]["prompt"]
    assert created[1]["metadata"] == BODIES[1]["metadata"]
    assert created[2]["messages"][0]["content"] == BODIES[2]["messages"][0]["content"]


def test_a_chunk_with_a_taken_id_is_refused_whole_as_an_insert_is(settings: Settings) -> None:
    first = made(settings)
    with db.transaction() as connection:
        transitions.create(Tx(connection, After("api")), first)
    again = [*made(settings)[:2], first[3]]  # the last one's id is taken
    with pytest.raises(IntegrityError), db.transaction() as connection:
        transitions.create(Tx(connection, After("api")), again)
    assert stored([job.id for job in again[:2]]) == []  # nothing of the chunk is left
