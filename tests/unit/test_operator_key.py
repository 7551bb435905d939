"""The Helm chart's first operator key: `inferq migrate --operator-key-env VAR` stores the key
a Secret holds, once, never printing it; a revoked one stays revoked (docs/kubernetes.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli.main import main
from app.core.db import session_scope
from app.core.tenants.keys import key_for, revoke_key
from tests.unit.conftest import environment

KEY = "iq_" + "k" * 40


def migrate(runner: CliRunner, **env: str) -> tuple[int, str]:
    done = runner.invoke(
        main, ["migrate", "--operator-key-env", "OPERATOR_API_KEY"], env=env, catch_exceptions=False
    )
    return done.exit_code, done.output


def test_the_key_is_stored_once_and_never_printed(tmp_path: Path) -> None:
    runner = CliRunner()
    with environment(data_dir=str(tmp_path), database_url=""):
        code, out = migrate(runner, OPERATOR_API_KEY=KEY)
        assert code == 0 and "stored" in out and KEY not in out
        with session_scope() as session:
            row = key_for(session, KEY)
            assert row is not None and row.operator and row.tenant == "operator"
            first = row.id
        code, out = migrate(runner, OPERATOR_API_KEY=KEY)
        assert code == 0 and "already stored" in out and KEY not in out
        with session_scope() as session:
            revoke_key(session, first)
        migrate(runner, OPERATOR_API_KEY=KEY)
        with session_scope() as session:
            assert key_for(session, KEY) is None  # revoked stays revoked


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("", "OPERATOR_API_KEY is empty or not set"),
        ("not-a-key", "invalid_key"),
        ("iq_short", "invalid_key"),
    ],
)
def test_a_missing_or_malformed_key_fails_the_job(tmp_path: Path, value: str, said: str) -> None:
    with environment(data_dir=str(tmp_path), database_url=""):
        code, out = migrate(CliRunner(), OPERATOR_API_KEY=value)
    assert code != 0 and said in out
