"""Property-based requests generated from the OpenAPI schema (schemathesis) against a live API
and worker: whatever the input, the server never answers 500.

Bounded: a fixed seed, ``MAX_EXAMPLES`` per operation, loopback only, an instant simulated
engine (realtime calls wait for their job) and a time limit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.support import Stack

MAX_EXAMPLES = 10
TIME_LIMIT_S = 240


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresDatabases) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    # PostgreSQL: the stricter store (its text refuses NUL, which the store escapes there).
    stack = Stack(
        tmp,
        postgres.create(),
        fresh_redis_url(),
        require_auth="true",
        sim_time_scale=0,
        # The fuzzer submits whatever the schema allows; small bounds keep the work it makes
        # for the worker (and so the run) short.
        max_tokens_limit=64,
        bulk_max_jobs=10,
    )
    try:
        stack.migrate()
        created = stack.cli("keys", "create", "--tenant", "fuzz")
        assert created.returncode == 0, created.stderr
        stack.api_key = created.stdout.strip()
        stack.start_api()
        stack.start_worker()
        yield stack
    finally:
        stack.stop()


def test_no_input_makes_a_server_error(stack: Stack) -> None:
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    if cli is None:
        pytest.fail("schemathesis is not installed (the dev extra has it)")
    done = subprocess.run(
        [
            cli,
            "run",
            f"{stack.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            str(MAX_EXAMPLES),
            "--seed",
            "1",
            "--request-timeout",
            "30",
            "--header",
            f"Authorization: Bearer {stack.api_key}",
        ],
        cwd=stack.tmp,  # schemathesis keeps a cache directory where it runs
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT_S,
        check=False,
    )
    report = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, report
    assert "generated" in report and "passed" in report
    api_log = (stack.tmp / "logs" / "api.log").read_text()
    assert " 500 " not in api_log and "Traceback" not in api_log, api_log[-4000:]
