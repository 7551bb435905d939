"""The built-in demo model: a tiny Llama with random weights and an offline-trained tokenizer.

With no ``INFERQ_MODEL`` the worker builds it once into the cache dir, so the vllm and hf engines
run with no download. The tokenizer is a byte-level BPE trained on the Python standard library's
own source files (always on disk); the weights are seeded random values, with the special tokens'
output rows zeroed so greedy decoding never ends a completion at once.
"""

from __future__ import annotations

import logging
import shutil
import sysconfig
import tempfile
from pathlib import Path

from filelock import FileLock

log = logging.getLogger("inferq.engine.demo")

DEMO_VERSION = "v2"  # v2: the chat template shows tools and tool calls
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


# The plain template (workers/engines/base.py's fallback) with tools, hermes-style: the tools as
# JSON in a system block, and an assistant's calls as <tool_call>{"name", "arguments"}</tool_call>
# (what vLLM's ``hermes`` tool parser reads). A chat without tools renders as with the fallback.
CHAT_TEMPLATE = (
    '{% if tools %}<|system|>\nCall a tool as <tool_call>{"name": ..., "arguments": {...}}'
    "</tool_call>. Tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m.content is defined and m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls is defined and m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def demo_model_dir(cache_dir: Path) -> Path:
    return cache_dir / f"demo-llama-{DEMO_VERSION}"


def ensure_demo_model(cache_dir: Path) -> Path:
    """Build the demo model into ``cache_dir`` if it is not there; safe across processes."""
    target = demo_model_dir(cache_dir)
    if (target / ".complete").exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / ".complete").exists():
            return target
        log.info("building the demo model in %s (first use only)", target)
        staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=cache_dir))
        try:
            _build(staging)
            (staging / ".complete").write_text(DEMO_VERSION)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in stdlib.glob("*.py"))[:80]


def _build(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train(_corpus(), trainer)
    pad, bos, eos = SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token=bos, eos_token=eos, pad_token=pad, padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention rejects smaller heads.
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[: len(SPECIAL_TOKENS)].zero_()
    model.to(torch.bfloat16).save_pretrained(out)


def ensure_demo_adapter(cache_dir: Path, target: Path) -> Path:
    """Build the demo model's LoRA adapter into ``target`` if it is not there (random weights,
    strong enough that the adapter's greedy text differs from the base model's)."""
    if (target / ".complete").exists():
        return target
    model = ensure_demo_model(cache_dir)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / ".complete").exists():
            log.info("building the demo LoRA adapter in %s (first use only)", target)
            write_lora_adapter(model, target)
            (target / ".complete").write_text(DEMO_VERSION)
    return target


def write_lora_adapter(model_dir: Path, out: Path, rank: int = 8, seed: int = 1) -> None:
    """A random LoRA adapter of a Llama model in PEFT's format, on q_proj and v_proj of every
    layer (vLLM loads this format)."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_width = config.get("num_key_value_heads", heads) * (hidden // heads)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, width in (("q_proj", hidden), ("v_proj", kv_width)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) / 2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(width, rank, generator=generator) / 2
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
                "fan_in_fan_out": False,
                "base_model_name_or_path": str(model_dir),
            }
        )
    )
