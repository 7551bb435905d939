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
