"""Which vLLM releases the ``vllm`` engine runs on, and which of its paths each one lacks.

The range is what GPU hosts have (docs/gpu.md, "vLLM versions"): vLLM 0.20-0.26 pin torch 2.11,
0.27-0.32 torch 2.13, 0.33 torch 2.14. What each path needs was read from every release's own
source in that range (0.20.0-0.33.0: the imports and signatures workers/engines/vllm.py uses):

- generation (``AsyncLLM``, ``SamplingParams``, ``StructuredOutputsParams``, LoRA, the stat
  logger) and embeddings (``PoolingParams``) are the same in all of them;
- scoring pairs renders them with the cross-encoder IO processor's ``render`` and
  ``ScoringRenderParams``, both first in 0.26 (``ChatTemplateConfig`` moved from
  ``vllm.entrypoints.chat_utils`` to ``vllm.renderers.chat_utils`` in 0.32: both are tried);
- tool calls stream through ``vllm.tool_parsers.streaming``, whose
  ``extract_required_tool_call_streaming`` took other arguments before 0.32 (and which 0.20
  does not have); inferq's calls match 0.32's, so tool calls need 0.32.

The engine refuses, clearly and before it serves anything, what the installed release cannot
do: a release outside the range at start, a scoring model at start, a job with tools when it
reaches the engine (the worker keeps serving the rest).
"""

from __future__ import annotations

import functools

Release = tuple[int, int]

OLDEST: Release = (0, 20)
NEWEST: Release = (0, 33)
# The oldest release each path runs on (the module's docstring says why).
NEEDS: dict[str, Release] = {"score": (0, 26), "tools": (0, 32)}
WHAT = {"score": "scoring pairs (a cross-encoder)", "tools": "tool calls"}


@functools.cache  # one installed release a process; a job with tools asks on every call
def release(version: str) -> Release | None:
    """``0.25.1``, ``0.32.0+cpu``, ``0.33.0rc1.dev5`` -> (0, 25), (0, 32), (0, 33); None for
    what is not a version (a source tree without its version file says ``dev``)."""
    from packaging.version import InvalidVersion, Version  # vLLM's own dependency

    try:
        parts = Version(version).release
    except InvalidVersion:
        return None
    return parts[0], (parts[1] if len(parts) > 1 else 0)


def _named(r: Release) -> str:
    return f"{r[0]}.{r[1]}"


def unsupported(version: str) -> str | None:
    """Why the engine does not start on ``version``; None where it does."""
    found = release(version)
    if found is not None and OLDEST <= found <= NEWEST:
        return None
    return (
        f"vLLM {version} is not among the releases inferq's vllm engine runs on "
        f'({_named(OLDEST)}-{_named(NEWEST)}, docs/gpu.md "vLLM versions"): install one, '
        f"e.g. pip install 'vllm>={_named(OLDEST)},<{NEWEST[0]}.{NEWEST[1] + 1}'"
    )


def lacks(path: str, version: str) -> str | None:
    """Why ``path`` (a key of ``NEEDS``) does not run on ``version``; None where it does."""
    needed, found = NEEDS[path], release(version)
    if found is not None and found >= needed:
        return None
    return (
        f"{WHAT[path]} need vLLM {_named(needed)} or newer on the worker, and it runs vLLM "
        f'{version} (docs/gpu.md, "vLLM versions")'
    )
