"""The transformers engine: static batches of ``model.generate`` on CPU or GPU.

It has no continuous batching: the runner releases micro-batches to it
(workers/inference/runner.py), and whatever arrives together runs as one left-padded
``generate`` call in a thread, grouped by sampling settings. It streams nothing: each request
gets its whole text in one chunk.

Of vLLM's sampling options it honours top_k, min_p, repetition_penalty and min_tokens (as
``generate``'s own, the same for a whole batch, so they are part of the grouping),
skip_special_tokens and include_stop_str_in_output; a request that sets another fails with
``invalid_request`` naming it (``transformers`` has no presence or frequency penalty, and no
per-request logit bias, end-of-sequence override or stop token ids in one batched call).

A prompt of token ids is the model's input as it is (an id outside the vocabulary fails the
request as ``invalid_token_ids``, as vLLM does); ``prompt_logprobs`` (k) runs the model over
the prompt once more and gives each token but the first its log-probability, its rank and the k
best alternatives (vLLM's ``prompt_logprobs``); ``echo`` gives the prompt's text (token ids
decoded by the tokenizer). A stop string that ends the output is its ``stop_reason``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.core.settings import Settings
from workers.engines.base import (
    EngineRequestError,
    EngineStats,
    GenChunk,
    GenRequest,
    PoolRequest,
    PoolResult,
    StepObserver,
    TokenWindow,
    ToolStream,
    apply_stop,
    chat_template_card,
    echo_text,
    hf_tokenizer_json,
    ignore_step,
    prompt_text,
    prompt_token_logprob,
    refuse_options,
    token_prompt,
    wrong_task,
)

log = logging.getLogger("inferq.engine.hf")


@dataclass(eq=False)
class _Pending:
    req: GenRequest
    prompt: str | list[int]  # the text, or the token ids as they are
    future: asyncio.Future[GenChunk] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


HONOURED = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "prompt_logprobs",
    }
)
# The options ``generate`` takes for a whole batch: requests run together only when they agree.
_BATCH_OPTIONS = ("top_k", "min_p", "repetition_penalty", "min_tokens")


def _sampling_key(req: GenRequest) -> tuple[Any, ...]:
    options = tuple(req.options.get(name) for name in _BATCH_OPTIONS)
    return (req.temperature > 0, req.temperature, req.top_p, *options)


class HFEngine:
    name = "hf"
    task = "generate"  # pooling models are vLLM's (docs/engines.md, "Pooling models")
    embed_dim: int | None = None
    matryoshka = False
    continuous_batching = False
    own_processes = False
    tool_parser: str | None = None  # tool_choice auto is refused (refuse_options)

    def __init__(self, model: str | Path, model_name: str, settings: Settings) -> None:
        if settings.model_task not in ("auto", "generate"):
            raise ValueError(
                f"the hf engine serves generation models: INFERQ_MODEL_TASK={settings.model_task} "
                "needs the vllm engine (or the simulated one)"
            )
        self.model_path = str(model)
        self.model_name = model_name
        self.max_batch = settings.micro_batch_max_size
        self.device_setting = settings.hf_device
        self.max_model_len = settings.max_model_len
        self._pending: list[_Pending] = []
        self._running = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._tokens = TokenWindow()
        self.on_step: StepObserver = ignore_step
        self._model: Any = None
        self._tokenizer: Any = None
        self._device = "cpu"
        self._vocabulary = 0  # token ids below it are the model's (known once loaded)

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="hf-engine")

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = self.device_setting
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self._device = device
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        self._model = model.to(device).eval()
        self._tokenizer = tokenizer
        # vLLM's bound: the larger of the tokenizer's and the model's vocabulary.
        self._vocabulary = max(len(tokenizer), int(getattr(model.config, "vocab_size", 0)))
        if not self.max_model_len:
            self.max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
        log.info("transformers model %s loaded on %s", self.model_path, device)

    def extract_tool_calls(
        self, text: str, tools: Sequence[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        # Never asked: generate refuses tools (refuse_options), as this engine has no parser.
        raise EngineRequestError("invalid_request", "tools: not supported by the hf engine")

    def tool_stream(self, tools: Mapping[str, Any]) -> ToolStream:
        # Never asked either (generate refuses tools).
        raise EngineRequestError("invalid_request", "tools: not supported by the hf engine")

    def tokenizer_json(self) -> str | None:
        return hf_tokenizer_json(self._tokenizer)

    def chat_template(self) -> dict[str, Any] | None:
        return chat_template_card(self._tokenizer)

    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        assert self._wake is not None, "start() first"
        refuse_options(req, HONOURED, self.name)
        if req.adapter is not None:
            raise EngineRequestError(
                "adapter_not_supported",
                f"{req.adapter!r} is a LoRA adapter: the hf engine runs none (vllm does)",
            )
        ids = token_prompt(req)
        if ids is not None:
            for token in (min(ids), max(ids)):  # vLLM's check and words
                if not 0 <= token < self._vocabulary:
                    raise EngineRequestError(
                        "invalid_token_ids", f"Token id {token} is out of vocabulary"
                    )
        item = _Pending(req, ids if ids is not None else prompt_text(req, self._tokenizer))
        self._pending.append(item)
        self._wake.set()
        try:
            yield await item.future
        finally:
            if not item.future.done():
                item.future.cancel()

    async def pool(self, req: PoolRequest) -> PoolResult:
        raise wrong_task(self.name, self.model_name, self.task, req.task)

    async def abort(self, request_id: str) -> None:
        for item in self._pending:
            if item.req.request_id == request_id and not item.future.done():
                item.future.set_result(GenChunk("", 0, "abort", None))
        self._pending = [p for p in self._pending if not p.future.done()]

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self._running,
            waiting=len(self._pending),
            generated_tokens_per_s=self._tokens.per_s(),
            extra={"device": self._device},
        )

    async def shutdown(self) -> None:
        for item in self._pending:
            if not item.future.done():
                item.future.set_result(GenChunk("", 0, "abort", None))
        self._pending = []
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            # Let every request released in the same loop tick join this batch.
            await asyncio.sleep(0)
            self._pending = [p for p in self._pending if not p.future.done()]
            if not self._pending:
                self._wake.clear()
                continue
            key = _sampling_key(self._pending[0].req)
            batch = [p for p in self._pending if _sampling_key(p.req) == key][: self.max_batch]
            self._pending = [p for p in self._pending if p not in batch]
            self._running = len(batch)
            try:
                results = await asyncio.to_thread(self._run_batch, batch)
            except Exception as exc:  # a failed batch fails its requests, not the engine
                log.exception("transformers batch failed")
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(exc)
            else:
                for item, chunk in zip(batch, results, strict=True):
                    if not item.future.done():
                        item.future.set_result(chunk)
                generated = sum(c.num_tokens for c in results)
                self._tokens.add(generated)
                # A micro-batch runs to its end in one call: it is this engine's "step".
                self.on_step(len(batch), generated)
            finally:
                self._running = 0

    def _run_batch(self, batch: list[_Pending]) -> list[GenChunk]:
        import torch

        tok = self._tokenizer
        # Left-padded: texts tokenized (with the tokenizer's special tokens), ids as they are.
        texts = [p.prompt for p in batch if isinstance(p.prompt, str)]
        encoded = iter(tok(texts)["input_ids"] if texts else [])
        prompts = [
            list(p.prompt) if not isinstance(p.prompt, str) else next(encoded) for p in batch
        ]
        prompt_lens = [len(ids) for ids in prompts]
        width = max(prompt_lens)
        enc = {
            "input_ids": torch.tensor(
                [[tok.pad_token_id] * (width - len(ids)) + ids for ids in prompts]
            ),
            "attention_mask": torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts]
            ),
        }
        max_new = max(p.req.max_tokens for p in batch)
        max_new = max(1, min(max_new, self.max_model_len - width))
        first = batch[0].req
        sample = first.temperature > 0
        if sample and first.seed is not None:
            torch.manual_seed(first.seed)
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new,
            "do_sample": sample,
            "pad_token_id": tok.pad_token_id,
        }
        options = first.options
        if sample:
            kwargs.update(temperature=first.temperature, top_p=first.top_p)
            if options.get("top_k", 0) > 0:
                kwargs["top_k"] = options["top_k"]
            if options.get("min_p", 0.0) > 0:
                kwargs["min_p"] = options["min_p"]
        if "repetition_penalty" in options:
            kwargs["repetition_penalty"] = options["repetition_penalty"]
        if options.get("min_tokens", 0) > 0:
            kwargs["min_new_tokens"] = options["min_tokens"]
        with torch.inference_mode():
            out = self._model.generate(**{k: v.to(self._device) for k, v in enc.items()}, **kwargs)
        chunks = []
        for row, item, prompt_len, ids_in in zip(out, batch, prompt_lens, prompts, strict=True):
            ids = row[width:].tolist()
            reason = "length"
            if tok.eos_token_id in ids:
                ids = ids[: ids.index(tok.eos_token_id)]
                reason = "stop"
            if len(ids) >= item.req.max_tokens:
                ids, reason = ids[: item.req.max_tokens], "length"
            wanted = item.req.options
            decoded = tok.decode(ids, skip_special_tokens=wanted.get("skip_special_tokens", True))
            keep = bool(wanted.get("include_stop_str_in_output"))
            text, matched = apply_stop(decoded, item.req.stop, include=keep)
            chunk = GenChunk(
                text,
                len(ids),
                "stop" if matched is not None else reason,
                int(prompt_len),
                stop_reason=matched,
            )
            if item.req.echo:
                chunk.prompt_text = echo_text(item.req, tok.decode)
            if wanted.get("prompt_logprobs") is not None:
                chunk.prompt_logprobs = self._prompt_logprobs(
                    ids_in, int(wanted["prompt_logprobs"])
                )
            chunks.append(chunk)
        return chunks

    def _prompt_logprobs(self, ids: list[int], top: int) -> list[dict[str, Any]]:
        """vLLM's ``prompt_logprobs`` of a prompt (``top`` alternatives a token, -1: all): one
        pass of the model over it; each token's logprob given those before it, its rank (1 +
        the tokens more likely), and the ``top`` most likely tokens, best first."""
        import torch

        tok = self._tokenizer
        with torch.inference_mode():
            logits = self._model(torch.tensor([ids], device=self._device)).logits[0, :-1]
            logprobs = torch.log_softmax(logits.float(), dim=-1)
        out = [prompt_token_logprob(ids[0], tok.decode([ids[0]]), None, None)]
        count = logprobs.shape[-1] if top < 0 else min(top, logprobs.shape[-1])
        best_values, best_ids = torch.topk(logprobs, count, dim=-1) if count else (None, None)
        for p in range(1, len(ids)):
            row = logprobs[p - 1]
            own = row[ids[p]]
            alternatives = []
            if best_ids is not None and best_values is not None:
                alternatives = [
                    (int(i), tok.decode([int(i)]), float(v), r)
                    for r, (i, v) in enumerate(
                        zip(best_ids[p - 1].tolist(), best_values[p - 1].tolist(), strict=True),
                        start=1,
                    )
                ]
            rank = int((row >= own).sum())  # vLLM's: the tokens at least as likely
            out.append(
                prompt_token_logprob(ids[p], tok.decode([ids[p]]), float(own), rank, alternatives)
            )
        return out
