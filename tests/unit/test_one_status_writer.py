"""Every piece of state has one writer, and what follows a commit has one runner.

- ``jobs.status`` and a job's sent sub-state (``enqueued_at``, ``charged``) are written only by
  app/core/lifecycle/transitions.py; ``batches.status`` and the ops worker's lease on a batch
  (``claimed_at``) only by app/batches/transitions.py (docs/architecture.md, "Job states" and
  "Batches").
- An ``After`` is built and run only by app/core/lifecycle/after.py and
  app/core/lifecycle/changes.py, and webhook events are announced only there and by the outbox's own
  thread: "commit, then run what follows" is one construct (``changes``).

The source of every product module is read (its syntax tree, not its text) for the ways a
column can be written: an UPDATE or INSERT of the model whose values name the column (or pass
values the reader cannot see, ``**values`` or a whole row), the model built with the column, an
assignment to ``<model>.<column>``, and raw SQL that updates the table's column. The checker is
run on planted violations too, so a check that finds nothing is a check that can find something.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The names the jobs' owner's compare-and-set has had (``to=`` makes it a status change).
CAS = {"compare_and_set", "_compare_and_set", "job_update"}


@dataclass(frozen=True)
class State:
    """Columns of one table with one writer."""

    name: str
    model: str  # the ORM class
    table: str
    columns: frozenset[str]
    owner: Path

    @property
    def raw_sql(self) -> re.Pattern[str]:
        columns = "|".join(sorted(self.columns))
        return re.compile(
            rf"\b(update\s+{self.table}\b.*\bset\b.*\b({columns})\b|insert\s+into\s+{self.table}\b)",
            re.I | re.S,
        )


JOB_STATUS = State(
    "jobs.status", "Job", "jobs", frozenset({"status"}), Path("app/core/lifecycle/transitions.py")
)
JOB_SENT = State(
    "a job's sent sub-state",
    "Job",
    "jobs",
    frozenset({"enqueued_at", "charged"}),
    Path("app/core/lifecycle/transitions.py"),
)
BATCH_STATUS = State(
    "batches.status and claimed_at",
    "Batch",
    "batches",
    frozenset({"status", "claimed_at"}),
    Path("app/batches/transitions.py"),
)
STATES = [JOB_STATUS, JOB_SENT, BATCH_STATUS]


def _is_model(node: ast.AST, state: State, aliases: set[str]) -> bool:
    """``Job``, ``Job.__table__``, or a name bound to either (``table = cast(Table, Job...)``)."""
    if isinstance(node, ast.Name):
        return node.id == state.model or node.id in aliases
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "__table__"
        and _is_model(node.value, state, aliases)
    )


def _aliases(tree: ast.AST, state: State) -> set[str]:
    """Names assigned from an expression that mentions the model."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id == state.model for n in ast.walk(node.value)
        ):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return found


def _values_name(call: ast.Call, columns: frozenset[str]) -> bool:
    for keyword in call.keywords:
        if keyword.arg is None or keyword.arg in columns:  # a column=..., or **values unseen
            return True
    for arg in call.args:
        if not isinstance(arg, ast.Dict):
            return True  # a row or a list of rows: it may hold anything
        if any(k is None or (isinstance(k, ast.Constant) and k.value in columns) for k in arg.keys):
            return True
    return False


def _chain_base(node: ast.AST) -> ast.AST:
    """The start of a method chain: ``update(Job)`` in ``update(Job).where(...).values``."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        elif isinstance(node, ast.Attribute):
            node = node.value
        else:
            return node


def _is_statement(node: ast.AST, state: State, aliases: set[str], statements: set[str]) -> bool:
    """``update(Job ...)``, or a name bound to one (``statement = update(Job).where(...)``)."""
    base = _chain_base(node)
    if isinstance(base, ast.Name):
        return base.id in statements
    return (
        isinstance(base, ast.Call)
        and isinstance(base.func, ast.Name)
        and base.func.id == "update"
        and bool(base.args)
        and _is_model(base.args[0], state, aliases)
    )


def _cas_writes(node: ast.Call, state: State) -> bool:
    """The jobs' compare-and-set, called from elsewhere: ``to=`` changes the status; other
    columns are values of its UPDATE."""
    if state.model != "Job":
        return False
    if state is JOB_STATUS:
        return any(k.arg in (None, "to") for k in node.keywords)
    return any(k.arg is None or k.arg in state.columns for k in node.keywords)


def writes(source: str, state: State) -> list[int]:
    """Lines of ``source`` that write ``state``'s columns."""
    tree = ast.parse(source)
    aliases = _aliases(tree, state)
    statements: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_statement(node.value, state, aliases, statements):
            statements |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            new_row = name == "insert" and node.args and _is_model(node.args[0], state, aliases)
            built = name == state.model and _values_name(node, state.columns)
            if new_row or built or (name in CAS and _cas_writes(node, state)):
                found.add(node.lineno)  # a new row holds its status (and may be sent)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            values = (
                attr == "values"
                and _is_statement(node.func.value, state, aliases, statements)
                and _values_name(node, state.columns)
            )
            if values or (attr in CAS and _cas_writes(node, state)):
                found.add(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr in state.columns
                    and isinstance(target.value, ast.Name)
                    and state.model.lower() in target.value.id.lower()
                ):
                    found.add(node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and state.raw_sql.search(node.value)
        ):
            found.add(node.lineno)
    return sorted(found)


def product_modules() -> list[Path]:
    return sorted(
        path.relative_to(REPO)
        for folder in ("app", "workers", "bench")
        for path in (REPO / folder).rglob("*.py")
    )


@pytest.mark.parametrize("state", STATES, ids=lambda s: s.name)
def test_only_the_owner_writes(state: State) -> None:
    offenders = {
        str(path): lines
        for path in product_modules()
        if path != state.owner and (lines := writes((REPO / path).read_text(), state))
    }
    assert offenders == {}, f"{state.name} is written outside {state.owner}: {offenders}"


@pytest.mark.parametrize("state", STATES, ids=lambda s: s.name)
def test_the_owner_is_found_writing(state: State) -> None:
    """The owner's own writes are seen: the checker reads the forms the product uses."""
    assert len(writes((REPO / state.owner).read_text(), state)) >= 3


PLANTED = {
    JOB_STATUS: [
        "update(Job).where(Job.id == i).values(status='failed')",
        "update(Job).where(Job.id == i).values(**values)",
        "update(Job.__table__).values({'status': 'queued'})",
        "s = update(Job).where(Job.id == i); s = s.where(Job.lease_token == 2); s.values(**v)",
        "connection.execute(transitions.compare_and_set(i, expect='queued', to='expired'))",
        "connection.execute(job_update(i, expect='running', to='queued'))",
        "connection.execute(insert(Job), rows)",
        "table = cast(Table, Job.__table__); connection.execute(insert(table), rows)",
        "session.add(Job(id='j', status='queued'))",
        "job.status = JobStatus.CANCELLED",
        "session.execute(text('UPDATE jobs SET status = :s WHERE id = :i'))",
    ],
    JOB_SENT: [
        "update(Job).where(Job.id.in_(ids)).values(enqueued_at=None, charged=0)",
        "update(Job).where(Job.id == i).values(charged=Job.cost)",
        "s = update(Job).where(Job.id == i); s.values(enqueued_at=None)",
        "update(Job.__table__).values({'enqueued_at': 1.0})",
        "connection.execute(transitions.compare_and_set(i, expect='queued', enqueued_at=None))",
        "connection.execute(insert(Job), rows)",
        "session.add(Job(id='j', enqueued_at=1.0))",
        "job.enqueued_at = None",
        "session.execute(text('UPDATE jobs SET charged = 0 WHERE id = :i'))",
    ],
    BATCH_STATUS: [
        "update(Batch).where(Batch.id == i).values(status='failed')",
        "update(Batch).where(Batch.id == i).values(claimed_at=None)",
        "update(Batch).where(Batch.id == i).values(**extra)",
        "s = update(Batch).where(Batch.id == i); s.values(status=BatchStatus.CANCELLING)",
        "connection.execute(insert(Batch).values(id=i))",
        "session.add(Batch(id='b', status='validating'))",
        "batch.status = BatchStatus.CANCELLED",
        "session.execute(text('UPDATE batches SET status = :s WHERE id = :i'))",
    ],
}

HARMLESS = {
    JOB_STATUS: [
        "update(Job).where(Job.status == 'running').values(lease_expires_at=1.0)",
        "update(Batch).values(status='cancelling')",
        "event.status = WebhookStatus.PENDING",
        "select(Job.status).where(Job.status == 'queued')",
        "s = update(Job).where(Job.id == i); s.values(enqueued_at=None)",
        "compare_and_set(i, expect='running', cancel_requested_at=1.0)",
    ],
    JOB_SENT: [
        "update(Job).where(Job.status == 'running').values(lease_expires_at=1.0)",
        "select(Job.enqueued_at).where(Job.enqueued_at.is_(None))",
        "compare_and_set(i, expect='running', to='queued', lease_owner=None)",
        "update(WebhookEvent).values(dispatched_at=None)",
    ],
    BATCH_STATUS: [
        "update(Batch).where(Batch.id == i).values(expired_at=1.0)",
        "update(Job).where(Job.id == i).values(status='queued')",
        "select(Batch.status).where(Batch.claimed_at.is_(None))",
        "event.status = WebhookStatus.PENDING",
    ],
}


@pytest.mark.parametrize(
    ("state", "planted"),
    [(state, line) for state, lines in PLANTED.items() for line in lines],
    ids=lambda v: v.name if isinstance(v, State) else v,
)
def test_planted_writes_are_caught(state: State, planted: str) -> None:
    assert writes(f"def f():\n    {planted}\n", state) == [2]


@pytest.mark.parametrize(
    ("state", "harmless"),
    [(state, line) for state, lines in HARMLESS.items() for line in lines],
    ids=lambda v: v.name if isinstance(v, State) else v,
)
def test_other_writes_are_not_taken_for_these(state: State, harmless: str) -> None:
    assert writes(f"def f():\n    {harmless}\n", state) == []


# --- what follows a commit: one construct ---------------------------------------------------

RUNNERS = {Path("app/core/lifecycle/after.py"), Path("app/core/lifecycle/changes.py")}
ANNOUNCERS = RUNNERS | {Path("app/core/webhooks/outbox.py")}  # the outbox's own announcer thread


def _text(node: ast.AST) -> str:
    return ast.unparse(node)


def effects_run(source: str, path: Path) -> list[int]:
    """Lines of ``source`` (module ``path``) that build or run an ``After`` or announce webhook
    events themselves, instead of leaving it to ``changes``."""
    found: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = _text(func)
        if path not in RUNNERS and (
            called.split(".")[-1] in ("After", "emit")
            or called.endswith("changes._run")
            or (isinstance(func, ast.Attribute) and func.attr == "run" and "after" in called)
        ):
            found.add(node.lineno)
        if path not in ANNOUNCERS and called in ("announce", "outbox.announce"):
            found.add(node.lineno)
    return sorted(found)


def test_only_the_construct_runs_what_follows_a_commit() -> None:
    offenders = {
        str(path): lines
        for path in product_modules()
        if (lines := effects_run((REPO / path).read_text(), path))
    }
    assert offenders == {}, (
        f"an After is built or run outside app/core/lifecycle/changes.py: {offenders}"
    )


@pytest.mark.parametrize(
    "planted",
    [
        "after.run()",
        "tx.after.run(announce=self.announcer.put)",
        "after = transitions.After('ops'); stop(after)",
        "After('api', events=ids)",
        "outbox.announce(events)",
        "announce(event_ids)",
        "changes._run(after, outbox.announce)",
    ],
)
def test_planted_effects_are_caught(planted: str) -> None:
    assert effects_run(f"def f():\n    {planted}\n", Path("app/batches/finalize.py")) == [2]


@pytest.mark.parametrize(
    "harmless",
    [
        "with changes('api') as tx: transitions.cancel(tx, i, now())",
        "tx.after.events.append(event.id)",
        "self.runner.run(stop)",
        "dispatcher.run(stop)",
        "self.recorder.announce(ids)",
    ],
)
def test_the_construct_and_other_runs_are_not_taken_for_effects(harmless: str) -> None:
    assert effects_run(f"def f():\n    {harmless}\n", Path("app/batches/finalize.py")) == []


# --- deleting a job: one writer, which takes what hangs on it too ---------------------------

JOB_DELETER = Path("app/core/lifecycle/transitions.py")
DELETE_JOBS = re.compile(r"\bdelete\s+from\s+jobs\b", re.I)


def job_deletes(source: str) -> list[int]:
    """Lines of ``source`` that delete jobs: ``delete(Job ...)`` (or of a name bound to the
    model) or raw SQL. What hangs on a job has no foreign key to it (migration 0016), so a job
    deleted elsewhere would leave its idempotency key, stored response and events behind."""
    tree = ast.parse(source)
    aliases = _aliases(tree, JOB_STATUS)
    found: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "delete"
            and node.args
            and _is_model(node.args[0], JOB_STATUS, aliases)
        ) or (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and DELETE_JOBS.search(node.value)
        ):
            found.add(node.lineno)
    return sorted(found)


def test_only_delete_finished_deletes_jobs() -> None:
    offenders = {
        str(path): lines
        for path in product_modules()
        if path != JOB_DELETER and (lines := job_deletes((REPO / path).read_text()))
    }
    assert offenders == {}, f"jobs are deleted outside {JOB_DELETER}: {offenders}"
    assert job_deletes((REPO / JOB_DELETER).read_text())  # and the owner's own is seen


@pytest.mark.parametrize(
    "planted",
    [
        "connection.execute(delete(Job).where(Job.id == i))",
        "connection.execute(delete(Job.__table__))",
        "table = cast(Table, Job.__table__); connection.execute(delete(table))",
        "session.execute(text('DELETE FROM jobs WHERE id = :i'))",
    ],
)
def test_planted_job_deletes_are_caught(planted: str) -> None:
    assert job_deletes(f"def f():\n    {planted}\n") == [2]


@pytest.mark.parametrize(
    "harmless",
    [
        "connection.execute(delete(WebhookEvent).where(WebhookEvent.job_id == i))",
        "connection.execute(delete(File).where(File.id == i))",
        "session.execute(text('DELETE FROM jobs_archive'))",
    ],
)
def test_other_deletes_are_not_taken_for_job_deletes(harmless: str) -> None:
    assert job_deletes(f"def f():\n    {harmless}\n") == []
