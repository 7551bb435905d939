"""Where a command reads (app/cli/where.py): the settings `inferq up` keeps beside its data,
adopted by the commands run there, and one line for what a command could not reach.

The commands run as real subprocesses in a directory laid out as `inferq up` leaves it: a
migrated SQLite file and its settings file, naming a Redis database of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from app.cli import where
from app.core.messaging.names import PRESENCE_KEY_PREFIXES
from app.core.settings import Settings
from tests.conftest import fresh_redis_url
from tests.support import REPO, free_port, free_ports_in_a_row

WORKER = {"role": "inference", "worker_id": "gpu-host:4242", "engine": "simulated", "pid": 4242}


def clean_env(**values: str) -> dict[str, str]:
    """This process's environment without any INFERQ_ variable, plus ``values``; and without
    COLUMNS, so the output is a pipe's (200 columns, app/cli/status.py): under pytest-xdist
    COLUMNS said 80, and the workers table folded "gpu-host:4242" over five lines."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_") and k != "COLUMNS"}
    return {**env, "PYTHONPATH": str(REPO), **values}


def inferq(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def stack_dir(tmp_path: Path, migrated: Path, redis_url: str) -> Path:
    """A directory as `inferq up` leaves it in ./.inferq: its database and its settings file,
    naming ``redis_url`` (not the default Redis), and a worker announced there."""
    data = tmp_path / ".inferq"
    data.mkdir()
    shutil.copy(migrated, data / "inferq.db")
    settings = Settings(data_dir=data, redis_url=redis_url)
    where.keep(settings, {"INFERQ_REDIS_URL": redis_url, "INFERQ_API_KEY": "iq_secret"})
    record = {**WORKER, "seen_at": time.time()}
    key = PRESENCE_KEY_PREFIXES["inference"] + WORKER["worker_id"]
    redis.Redis.from_url(redis_url).set(key, json.dumps(record), ex=60)
    return data


def test_the_settings_file_holds_where_the_stack_runs_and_no_secret(
    tmp_path: Path, migrated: Path
) -> None:
    url = fresh_redis_url()
    data = stack_dir(tmp_path, migrated, url)
    path = data / where.SETTINGS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    kept = json.loads(path.read_text())["settings"]
    assert kept["INFERQ_REDIS_URL"] == url
    assert kept["INFERQ_DATABASE_URL"] == f"sqlite:///{data.resolve() / 'inferq.db'}"
    assert kept["INFERQ_FILES_DIR"] == str(data.resolve() / "files")
    assert (kept["INFERQ_API_HOST"], kept["INFERQ_API_PORT"]) == ("127.0.0.1", "8000")
    assert "INFERQ_API_URL" not in kept  # a port set in a client's shell must still win
    assert "INFERQ_API_KEY" not in kept and "iq_secret" not in path.read_text()


def test_status_beside_a_stack_reads_its_redis_and_says_what_it_read(
    tmp_path: Path, migrated: Path
) -> None:
    """Run in the stack's directory without its environment, `inferq status` reads the Redis
    the stack uses (its worker is listed), and its first line names the Redis, the database
    and the file store, and where they came from."""
    url = fresh_redis_url()
    data = stack_dir(tmp_path, migrated, url)
    # --no-api: what it reads itself (an API on the kept address, a stack someone else runs
    # there, would answer instead: test_status.py has the command asking one).
    done = inferq(tmp_path, "status", "--no-api")
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert f"Redis {url}, database sqlite:///{data.resolve() / 'inferq.db'}" in first, first
    assert f"files local directory {data.resolve() / 'files'}" in first, first
    assert str(data.resolve() / where.SETTINGS_FILE) in first, first
    assert "gpu-host:4242" in done.stdout, done.stdout
    assert "no worker is announced" not in done.stdout

    # The environment still wins over the file: here, another Redis database with no worker.
    other = fresh_redis_url()
    done = inferq(tmp_path, "status", "--no-api", INFERQ_REDIS_URL=other)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert f"Redis {other}," in first and "INFERQ_REDIS_URL from the environment" in first
    assert "no worker is announced" in done.stdout


def test_client_commands_say_in_one_line_what_they_could_not_reach(tmp_path: Path) -> None:
    """No traceback: the URL tried and the setting that chose it."""
    port = free_port()
    for args in (["submit", "hello"], ["get", "job_x"]):
        done = inferq(tmp_path, *args, INFERQ_API_PORT=str(port))
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"Error: cannot reach the API at http://127.0.0.1:{port} (INFERQ_API_HOST and "
            "INFERQ_API_PORT, or INFERQ_API_URL): [Errno 111] Connection refused"
        ]
    api = f"http://127.0.0.1:{port}/prefix"
    done = inferq(tmp_path, "get", "job_x", INFERQ_API_URL=api)
    assert f"cannot reach the API at {api} (INFERQ_API_URL): " in done.stderr, done.stderr

    nowhere = f"postgresql+psycopg://inferq:hunter2@127.0.0.1:{free_port()}/inferq"
    done = inferq(tmp_path, "keys", "list", INFERQ_DATABASE_URL=nowhere)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip()
    assert len(line.splitlines()) == 1 and "hunter2" not in line
    assert line.startswith(
        f"Error: cannot read the database at {nowhere.replace('hunter2', '***')} "
        "(INFERQ_DATABASE_URL): "
    ), line

    # A database that is not there is named and not created (an empty SQLite file would be).
    done = inferq(tmp_path, "keys", "create", "--tenant", "t")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    looked = tmp_path.resolve() / ".inferq" / "inferq.db"
    assert f"no inferq database at {looked} (INFERQ_DATA_DIR '.inferq'" in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_up_refuses_fixed_metrics_ports_that_meet_before_starting_anything(
    tmp_path: Path,
) -> None:
    """With a fixed worker /metrics port and the embedding model, the embedding worker takes
    the next port; a setting that collides with it, or the port held, is refused at once, with
    the settings named (not an embedding worker dying with `Address already in use`)."""
    port = free_ports_in_a_row(2)
    env = {
        "INFERQ_DATA_DIR": str(tmp_path / "data"),
        "INFERQ_API_PORT": str(free_port()),
        "INFERQ_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        "INFERQ_WORKER_METRICS_PORT": str(port),
        "INFERQ_UP_EMBEDDING_MODEL": "minilm",
    }
    done = inferq(
        tmp_path, "up", "--engine", "simulated", **env, INFERQ_OPS_METRICS_PORT=str(port + 1)
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "INFERQ_OPS_METRICS_PORT and INFERQ_WORKER_METRICS_PORT + 1 (the embedding worker's "
        f"/metrics) are both port {port + 1}"
    ) in done.stdout, done.stdout
    with socket.socket() as held:
        held.bind(("127.0.0.1", port + 1))
        held.listen()
        done = inferq(tmp_path, "up", "--engine", "simulated", **env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        f"port 127.0.0.1:{port + 1} (INFERQ_WORKER_METRICS_PORT + 1 (the embedding worker's "
        "/metrics)) is held by pid"
    ) in done.stdout, done.stdout
    assert not (tmp_path / "data" / "redis").exists()  # nothing was started
