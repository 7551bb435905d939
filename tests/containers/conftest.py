"""The container layer's session: podman configured for this machine, every image built (or
found in podman's cache), podman's Docker API and the healthcheck runner, for
tests/containers/test_compose_stack.py. Where podman or its tools are missing the layer skips;
under INFERQ_TEST_REQUIRE_PODMAN=1 (.ci/run, which installs them) it fails instead."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.containers.podman import (
    HealthcheckRunner,
    Podman,
    Timings,
    containers_conf,
    missing_tools,
)

PROJECT = "inferqct"
TIMINGS = Timings()


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    missing = missing_tools()
    if missing:
        why = f"podman's tools are missing: {', '.join(missing)} (.ci/run installs them)"
        if os.environ.get("INFERQ_TEST_REQUIRE_PODMAN") == "1":
            pytest.fail(why)
        pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("the container layer runs podman as root (rootless needs subuids here)")
    return Podman(containers_conf(tmp_path_factory.mktemp("podman")))


@pytest.fixture(scope="session")
def images(podman: Podman) -> Podman:
    podman.build_all(TIMINGS)
    return podman


@pytest.fixture(scope="session")
def docker_host(images: Podman, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("podman-api")
    with images.docker_api(folder) as host, HealthcheckRunner(images, PROJECT):
        yield host


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The measured build and start times (docs/compose.md, quotes them)."""
    if TIMINGS.steps:
        terminalreporter.section("container timings")
        for name, seconds in TIMINGS.steps.items():
            terminalreporter.write_line(f"{name}: {seconds} s")
