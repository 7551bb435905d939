"""Private dependency servers for tests (chaos tests, and each xdist worker past the first): a
redis-server and a PostgreSQL cluster of their own on a free loopback port, so a test can stop,
restart or wipe them without touching the shared services (or another pytest process that uses
them).

Both are started in their own process group and always torn down by ``close()``, which a test
calls from a ``finally`` (or a fixture's teardown) so that nothing outlives a failed test.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import redis
from sqlalchemy import create_engine, text

from app.cli.stack import redis_server_argv
from app.core.processes.lifeline import dies_with_parent
from tests.support import free_port, log_tail, wait_until

REDIS_SERVER = os.environ.get("INFERQ_TEST_REDIS_SERVER", "/usr/bin/redis-server")
PG_BIN = Path(os.environ.get("INFERQ_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


class RedisServer:
    """A redis-server on 127.0.0.1 with its data in ``directory``; restartable on its port.

    Configured as `inferq up` configures its private one (``app.cli.stack.redis_server_argv``), so
    the outage tests exercise the durability inferq relies on. ``prefix`` runs it elsewhere (in
    a network namespace: ``ip netns exec NS``), listening on every address of that namespace,
    and ``host`` is the address this process reaches it at.
    """

    def __init__(
        self,
        directory: Path,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        extra: Sequence[str] = (),
    ) -> None:
        """``extra``: more redis-server arguments (``--replicaof HOST PORT`` for a replica)."""
        self.extra = list(extra)
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.prefix = list(prefix)
        self.port = free_port()
        self.log = self.dir / "redis.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0, host: str | None = None) -> str:
        return f"redis://{host or self.host}:{self.port}/{db}"

    def client(self) -> redis.Redis:
        return redis.Redis(
            host=self.host, port=self.port, socket_connect_timeout=1, socket_timeout=5
        )

    def start(self, timeout: float = 15) -> None:
        assert self.popen is None or self.popen.poll() is not None, "already running"
        elsewhere = ["--bind", "0.0.0.0"] if self.prefix else []
        argv = [
            *self.prefix,
            *redis_server_argv(REDIS_SERVER, self.port, self.dir),
            *elsewhere,
            *self.extra,
            "--protected-mode",
            "no" if self.prefix else "yes",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log),
        ]
        # Gone with the pytest process that started it, even one killed with -9 (a private
        # Redis of an xdist worker lives as long as that worker: tests/conftest.py).
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=dies_with_parent(),
        )

        def up() -> bool:
            if self.popen is not None and self.popen.poll() is not None:
                raise AssertionError(f"redis-server exited:\n{self.tail()}")
            with contextlib.closing(self.client()) as client:
                # With AOF on, PING answers LOADING while the file is replayed: wait for it.
                return bool(client.ping()) and client.dbsize() >= 0

        wait_until(up, timeout, f"redis-server on port {self.port}", every=0.05)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM: Redis writes (and fsyncs) its append-only file, then exits."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"redis-server ignored SIGTERM for {timeout}s") from None

    def kill(self) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(timeout=5)
        self.kill()

    def tail(self, n: int = 30) -> str:
        return log_tail(self.log, n)


class SentinelSet:
    """A Redis master, one replica and three sentinels (Debian's ``redis-sentinel``) on
    loopback, all of their own: the set a production Redis with failover is. The sentinels
    call the master down after ``down_ms`` without an answer and, two of them agreeing,
    promote the replica; ``url`` is what inferq is given (docs/reliability.md, "Redis in
    production")."""

    MASTER = "inferq"

    def __init__(self, directory: Path, down_ms: int = 1000) -> None:
        self.master = RedisServer(directory / "master")
        self.replica = RedisServer(
            directory / "replica", extra=["--replicaof", "127.0.0.1", str(self.master.port)]
        )
        self.dir = directory
        self.down_ms = down_ms
        self.ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"sentinel://{hosts}/0?master_name={self.MASTER}"

    def start(self) -> None:
        binary = shutil.which("redis-sentinel")
        assert binary is not None, "redis-sentinel is not installed (.ci/run installs it)"
        self.master.start()
        self.replica.start()
        wait_until(
            lambda: self.replica.client().info("replication")["master_link_status"] == "up",
            20,
            "the replica to sync",
        )
        for i, port in enumerate(self.ports):
            conf = self.dir / f"sentinel{i}.conf"  # a sentinel rewrites its own file
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"logfile {self.dir / f'sentinel{i}.log'}\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER} {self.down_ms}\n"
                f"sentinel failover-timeout {self.MASTER} 10000\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n"
            )
            self.sentinels.append(
                subprocess.Popen(
                    [binary, str(conf)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

        def watching() -> bool:
            for port in self.ports:
                with contextlib.closing(redis.Redis(port=port, socket_timeout=1)) as client:
                    state = client.sentinel_master(self.MASTER)
                    if int(state.get("num-other-sentinels", 0)) < 2:
                        return False
                    if int(state.get("num-slaves", 0)) < 1:
                        return False
            return True

        wait_until(watching, 30, "the sentinels to know each other and the replica", every=0.2)

    def master_port(self) -> int:
        """The master the sentinels name now."""
        with contextlib.closing(redis.Redis(port=self.ports[0], socket_timeout=1)) as client:
            _host, port = client.sentinel_get_master_addr_by_name(self.MASTER)
        return int(port)

    def close(self) -> None:
        for popen in self.sentinels:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(10)
        self.replica.close()
        self.master.close()


class PostgresServer:
    """A throw-away PostgreSQL cluster (initdb) on 127.0.0.1 that a test may stop and start.

    PostgreSQL refuses to run as root: when we are root the cluster is owned by the
    ``postgres`` user and every server binary runs through ``runuser``. The cluster lives in a
    ``mkdtemp`` directory under /tmp (pytest's tmp dirs are not readable by other users).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        trusted: str | None = None,
    ) -> None:
        """``prefix`` runs the server elsewhere (``ip netns exec NS``) on every address there;
        ``host`` is where this process reaches it; ``trusted``, a network whose clients may
        connect without a password (only loopback otherwise)."""
        self.root = Path(tempfile.mkdtemp(prefix="inferq-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self.port = free_port()
        self.host = host
        self.listen = "*" if prefix else "127.0.0.1"
        self.as_user: list[str] = list(prefix)
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(self.root, owner.pw_uid, owner.pw_gid)
            self.as_user += ["runuser", "-u", "postgres", "--"]
        self._run(
            str(PG_BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "--no-sync", timeout=120,
        )  # fmt: skip
        if trusted is not None:
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {trusted} trust\n")

    def _run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*self.as_user, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            cwd=self.root,
            start_new_session=True,
        )
        assert done.returncode == 0, f"{argv[0]} failed:\n{done.stdout}\n{done.stderr}"
        return done

    def _ctl(self, *args: str, timeout: float = 60) -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), *args, timeout=timeout)

    def start(self) -> None:
        options = (
            f"-p {self.port} -c listen_addresses={self.listen} -k {self.root} "
            "-c fsync=off -c full_page_writes=off -c max_connections=300"
        )
        self._ctl("-o", options, "-l", str(self.log), "-w", "-t", "60", "start", timeout=90)

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "-w", "-t", "60", "stop", timeout=90)

    def running(self) -> bool:
        status = subprocess.run(
            [*self.as_user, str(PG_BIN / "pg_ctl"), "-D", str(self.data), "status"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return status.returncode == 0

    def url(self, database: str = "postgres", host: str | None = None) -> str:
        return f"postgresql+psycopg://postgres@{host or self.host}:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.stop(mode="immediate")
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, ProcessLookupError, PermissionError):
            # pg_ctl could not stop it: kill the postmaster (its children follow it).
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)
