"""`inferq status` starts without what it does not read with (issue 66: most of its time was
imports; docs/benchmarks.md): not Celery and kombu (the broker), not the request contract
(jsonschema, the tokenizers library), not httpx or the Prometheus parser; and, until it knows no
API answers (it asks the API first), not SQLAlchemy, redis-py or a database driver. A module
that pulls one of them back in on the status path fails here, in a fresh interpreter, before the
benchmark shows it (tests/integration/test_status.py runs the whole command both ways)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    *("celery", "kombu", "jsonschema", "tokenizers", "httpx", "prometheus_client", "fastapi"),
    *("sqlalchemy", "redis", "psycopg", "obstore"),
)


def test_the_status_command_imports_none_of_the_heavy_parts() -> None:
    probe = (
        "import json, sys\n"
        "import app.cli.main, app.cli.status\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout) == []
