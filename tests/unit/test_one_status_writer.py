"""Only app/core/transitions.py writes ``jobs.status`` (docs/architecture.md, "Job states").

The source of every product module is read (its syntax tree, not its text) for the ways a
status can be written: an UPDATE or INSERT of ``Job`` whose values name ``status`` (or pass
values the reader cannot see, ``**values`` or a whole row), a ``Job(...)`` built with a status,
an assignment to ``job.status``, and raw SQL that updates ``jobs`` with a status. The checker is
run on planted violations too, so a check that finds nothing is a check that can find something.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
OWNER = Path("app/core/transitions.py")
# The names the owner's compare-and-set has had (``to=`` makes it a status change).
CAS = {"compare_and_set", "_compare_and_set", "job_update"}
RAW_SQL = re.compile(r"\b(update\s+jobs\b.*\bset\b.*\bstatus|insert\s+into\s+jobs\b)", re.I | re.S)


def _is_job(node: ast.AST, aliases: set[str]) -> bool:
    """``Job``, ``Job.__table__``, or a name bound to either (``table = cast(Table, Job...)``)."""
    if isinstance(node, ast.Name):
        return node.id == "Job" or node.id in aliases
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "__table__"
        and _is_job(node.value, aliases)
    )


def _aliases(tree: ast.AST) -> set[str]:
    """Names assigned from an expression that mentions ``Job``."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(n, ast.Name) and n.id == "Job" for n in ast.walk(node.value)
        ):
            found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return found


def _values_name_status(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg in (None, "status"):  # status=..., or **values the reader cannot see
            return True
    for arg in call.args:
        if not isinstance(arg, ast.Dict):
            return True  # a row or a list of rows: it may hold anything
        if any(
            k is None or (isinstance(k, ast.Constant) and k.value == "status") for k in arg.keys
        ):
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


def _is_job_statement(node: ast.AST, aliases: set[str], statements: set[str]) -> bool:
    """``update(Job ...)``, or a name bound to one (``statement = update(Job).where(...)``)."""
    base = _chain_base(node)
    if isinstance(base, ast.Name):
        return base.id in statements
    return (
        isinstance(base, ast.Call)
        and isinstance(base.func, ast.Name)
        and base.func.id == "update"
        and bool(base.args)
        and _is_job(base.args[0], aliases)
    )


def status_writes(source: str) -> list[int]:
    """Lines of ``source`` that write ``jobs.status``."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    statements: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_job_statement(node.value, aliases, statements):
            statements |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            if name == "insert" and node.args and _is_job(node.args[0], aliases):
                found.add(node.lineno)  # a new job's row holds its status
            elif name == "Job" and any(k.arg in (None, "status") for k in node.keywords):
                found.add(node.lineno)
            elif name in CAS and any(k.arg in (None, "to") for k in node.keywords):
                found.add(node.lineno)  # the owner's compare-and-set, called from elsewhere
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CAS | {"values"}
            and (
                node.func.attr != "values"
                or _is_job_statement(node.func.value, aliases, statements)
            )
            and (
                _values_name_status(node)
                if node.func.attr == "values"
                else any(k.arg in (None, "to") for k in node.keywords)
            )
        ):
            found.add(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == "status"
                    and isinstance(target.value, ast.Name)
                    and "job" in target.value.id.lower()
                ):
                    found.add(node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and RAW_SQL.search(node.value)
        ):
            found.add(node.lineno)
    return sorted(found)


def product_modules() -> list[Path]:
    return sorted(
        path.relative_to(REPO)
        for folder in ("app", "workers")
        for path in (REPO / folder).rglob("*.py")
    )


def test_only_the_owner_writes_jobs_status() -> None:
    offenders = {
        str(path): lines
        for path in product_modules()
        if path != OWNER and (lines := status_writes((REPO / path).read_text()))
    }
    assert offenders == {}, f"jobs.status is written outside {OWNER}: {offenders}"


def test_the_owner_is_found_writing() -> None:
    """The owner's own writes are seen: the checker reads the forms the product uses."""
    assert len(status_writes((REPO / OWNER).read_text())) >= 4


@pytest.mark.parametrize(
    "planted",
    [
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
)
def test_planted_writes_are_caught(planted: str) -> None:
    assert status_writes(f"def f():\n    {planted}\n") == [2]


@pytest.mark.parametrize(
    "harmless",
    [
        "update(Job).where(Job.status == 'running').values(lease_expires_at=1.0)",
        "update(Batch).values(status='cancelling')",
        "event.status = WebhookStatus.PENDING",
        "select(Job.status).where(Job.status == 'queued')",
        "s = update(Job).where(Job.id == i); s.values(enqueued_at=None)",
        "compare_and_set(i, expect='running', cancel_requested_at=1.0)",
    ],
)
def test_other_writes_are_not_taken_for_status_writes(harmless: str) -> None:
    assert status_writes(f"def f():\n    {harmless}\n") == []
