"""The vLLM releases the vllm engine runs on, and what it refuses on the others
(workers/engines/vllm_releases.py): the range pyproject.toml's ``vllm`` extra asks for, read
from the releases' own version strings."""

from __future__ import annotations

import asyncio
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from app.core.settings import Settings
from workers.engines import vllm_releases
from workers.engines.base import EngineRequestError, GenRequest
from workers.engines.vllm import VLLMEngine

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.25.1", (0, 25)),
        ("0.32.0+cpu", (0, 32)),
        ("0.33.0rc1.dev5+g1234", (0, 33)),
        ("1", (1, 0)),
        ("dev", None),  # vLLM's source tree without its version file
    ],
)
def test_a_release_is_its_major_and_minor(version: str, expected: tuple[int, int] | None) -> None:
    assert vllm_releases.release(version) == expected


@pytest.mark.parametrize("version", ["0.20.0", "0.25.1", "0.32.0", "0.33.1"])
def test_the_engine_starts_on_every_release_in_the_range(version: str) -> None:
    assert vllm_releases.unsupported(version) is None


@pytest.mark.parametrize("version", ["0.19.1", "0.11.1rc2.dev30+gabc", "0.34.0", "1.0.0", "dev"])
def test_the_engine_refuses_a_release_outside_the_range_and_names_it(version: str) -> None:
    refused = vllm_releases.unsupported(version)
    assert refused is not None
    assert version in refused and "0.20-0.33" in refused


def test_scoring_needs_0_26_and_tool_calls_0_32() -> None:
    assert vllm_releases.lacks("score", "0.26.0") is None
    assert vllm_releases.lacks("tools", "0.32.0") is None
    score = vllm_releases.lacks("score", "0.25.1")
    tools = vllm_releases.lacks("tools", "0.31.0")
    assert score is not None and "0.26" in score and "0.25.1" in score
    assert tools is not None and "tool calls" in tools and "0.32" in tools


def test_the_vllm_extra_asks_for_exactly_the_range_the_engine_runs_on() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (requirement,) = (Requirement(r) for r in pyproject["project"]["optional-dependencies"]["vllm"])
    oldest = ".".join(map(str, vllm_releases.OLDEST))
    newest = vllm_releases.NEWEST
    assert requirement.specifier.contains(f"{oldest}.0")
    assert not requirement.specifier.contains(f"0.{vllm_releases.OLDEST[1] - 1}.9")
    assert requirement.specifier.contains(f"{newest[0]}.{newest[1]}.9")
    assert not requirement.specifier.contains(f"{newest[0]}.{newest[1] + 1}.0")


def test_a_job_with_tools_is_refused_on_a_release_before_0_32_and_says_why() -> None:
    """The engine's own gate, before it hands vLLM anything: the job fails as invalid_request
    (the worker keeps serving), naming the release it runs."""
    engine = VLLMEngine("unused", "demo", Settings())
    engine.vllm_version = "0.31.0"
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}
    request = GenRequest(request_id="r1", messages=[{"role": "user", "content": "hi"}], tools=tools)

    async def first() -> object:
        return await anext(aiter(engine.generate(request)))

    with pytest.raises(EngineRequestError) as refused:
        asyncio.run(first())
    assert refused.value.code == "invalid_request"
    assert "0.31.0" in str(refused.value) and "0.32" in str(refused.value)
