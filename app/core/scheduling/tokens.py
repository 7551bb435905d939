"""Prompt token counts as the served model counts them, from the model card workers publish;
and whether the model can parse tool calls (``tool_choice: auto``).

The API holds no model, so it cannot know on its own how many tokens a prompt is or how long
the model's context is. Workers know both once their engine is up, and publish a **model card**
in Redis (``inferq:model:<served name>``): the engine's context length and its tokenizer, stored
beside it as a ``tokenizer.json`` under its digest (``inferq:tokenizer:<sha256>``; the simulated
engine's word counter is named ``words``). The API reads the card at most once per
``CARD_CACHE_S``, builds the tokenizer once per digest with the ``tokenizers`` library (no
torch, no vLLM), and counts:

- a ``prompt`` exactly as the engine does (with the tokenizer's special tokens);
- ``messages`` as the sum of their contents: a lower bound, since the chat template adds tokens
  of its own, so a refusal is always right; a prompt that only the template pushes past the
  context is refused by the engine (the job fails with ``context_length_exceeded``);
- a pooled job's inputs each as the engine does (a text with its special tokens, token ids as
  they are, a query and a document as one pair): each must fit the context whole (a pooler
  generates nothing) unless the job asks to truncate, and token ids must be in the vocabulary;
  ``dimensions`` other than the model's own size (its card's) only on a matryoshka model.

With no card yet (no worker has started) or no tokenizer to publish, nothing is checked here
and the engine stays the judge. The counts also feed the tokens-per-minute limit
(app/core/scheduling/limits.py), which falls back to an estimate of four characters a token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import redis

from app.core.errors import DomainError, Kind
from app.core.messaging import clients
from app.core.messaging.names import CARD_KEY_PREFIX, TOKENIZER_KEY_PREFIX
from app.core.settings import get_settings

if TYPE_CHECKING:  # annotations only: `inferq status` reads model cards without the contract
    from tokenizers import Tokenizer

    from app.core.contract.jobs import JobCreate, Prompt
    from app.core.contract.pooling import Inputs

log = logging.getLogger("inferq.tokens")

WORDS = "words"  # the simulated engine's tokenizer: words and punctuation marks
CARD_CACHE_S = 10.0
MAX_TOKENIZERS = 16  # tokenizers kept built, one per model card in use

_WORD_RE = re.compile(r"\w+|[^\w\s]")


def count_words(text: str) -> int:
    """The simulated tokenizer: words and punctuation marks."""
    return max(1, len(_WORD_RE.findall(text)))


@dataclass(frozen=True)
class ModelCard:
    """What the API needs to know about the served model."""

    model: str
    max_model_len: int
    tokenizer: str  # WORDS, "sha256:<hex>" of a stored tokenizer.json, or "" (none)
    tool_parser: str | None = None  # vLLM's parser of the model's tool calls, if it has one
    task: str = "generate"  # what the model does (JobKind), as its engine resolved it
    dimensions: int | None = None  # an embedding model's vectors
    matryoshka: bool = False  # an embedding model that takes ``dimensions``
    # The model's chat template, as the engine gives it (workers/engines/base.py,
    # chat_template_card: templates, formats, special_tokens); None without one. The API
    # renders ``POST /tokenize``'s messages with it (app/core/scheduling/chat_template.py).
    chat_template: dict[str, Any] | None = None


def publish(
    client: redis.Redis,
    model: str,
    max_model_len: int,
    tokenizer: str | None,
    tool_parser: str | None = None,
    task: str = "generate",
    dimensions: int | None = None,
    matryoshka: bool = False,
    chat_template: dict[str, Any] | None = None,
) -> ModelCard:
    """Store the card of ``model`` (``tokenizer``: a tokenizer.json, WORDS, or None)."""
    name = tokenizer or ""
    if tokenizer and tokenizer != WORDS:
        digest = hashlib.sha256(tokenizer.encode()).hexdigest()
        client.set(TOKENIZER_KEY_PREFIX + digest, tokenizer)
        name = f"sha256:{digest}"
    card = ModelCard(
        model, max_model_len, name, tool_parser, task, dimensions, matryoshka, chat_template
    )
    client.set(CARD_KEY_PREFIX + model, json.dumps(asdict(card)))
    return card


class Counter:
    """Counts prompt tokens for one model card."""

    def __init__(self, card: ModelCard, tokenizer: Tokenizer | None) -> None:
        self.card = card
        self._tokenizer = tokenizer

    def count(self, body: JobCreate) -> int:
        return sum(self.counts(body))

    def counts(self, body: JobCreate) -> list[int]:
        """The prompt tokens of each of a completion's prompts (token ids counted as they are,
        without the tokenizer), else the job's in one."""
        pooled = body.pooled_inputs()
        if pooled is not None:
            return [sum(self.count_items(pooled))]
        if body.messages is None:
            return self.count_items(body.prompts())
        texts = [m.text() for m in body.messages]
        if self._tokenizer is None:
            return [sum(count_words(text) for text in texts)]
        encoded = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [sum(len(e.ids) for e in encoded)]

    def count_items(self, inputs: Inputs | list[Prompt]) -> list[int]:
        """The tokens of each input of a pooled job, as its engine will see them."""
        if isinstance(inputs, dict):
            queries, documents = inputs["queries"], inputs["documents"]
            if len(queries) == 1:
                queries = queries * len(documents)
            pairs = list(zip(queries, documents, strict=True))
            if self._tokenizer is None:
                return [count_words(q) + count_words(d) for q, d in pairs]
            return [len(e.ids) for e in self._tokenizer.encode_batch(pairs)]
        texts = [item for item in inputs if isinstance(item, str)]
        if self._tokenizer is None:
            counted = iter([count_words(text) for text in texts])
        else:
            counted = iter(len(e.ids) for e in self._tokenizer.encode_batch(texts))
        return [next(counted) if isinstance(item, str) else len(item) for item in inputs]

    def check_inputs(self, inputs: Inputs, options: dict[str, Any], param: str) -> int:
        """A pooled job's tokens; refuses an input longer than the context (unless the job asks
        to truncate), token ids outside the vocabulary, and a request over
        ``INFERQ_POOL_MAX_REQUEST_TOKENS``."""
        dimensions = options.get("dimensions")
        # The model's own size cuts nothing, so any embedding model takes it (OpenAI's clients
        # send it); the engine then asks for the model's vectors as they are.
        own = dimensions is not None and dimensions == self.card.dimensions
        if dimensions is not None and not self.card.matryoshka and not own:
            raise DomainError(
                Kind.MALFORMED,
                "dimensions_not_supported",
                f"dimensions: this model's vectors have {self.card.dimensions} dimensions and it "
                "is not a matryoshka model, whose vectors may be cut: give "
                f"{self.card.dimensions} or leave it out",
                param="dimensions",
            )
        if dimensions is not None and self.card.dimensions and dimensions > self.card.dimensions:
            raise DomainError(
                Kind.INVALID,
                "invalid_dimensions",
                f"dimensions: at most this model's {self.card.dimensions}",
                param="dimensions",
            )
        vocabulary = self.vocabulary()
        if vocabulary is not None and not isinstance(inputs, dict):
            for i, item in enumerate(inputs):
                if isinstance(item, list) and any(token >= vocabulary for token in item):
                    raise DomainError(
                        Kind.INVALID,
                        "invalid_token_ids",
                        f"{param}.{i}: token ids must be below the model's vocabulary of "
                        f"{vocabulary}",
                        param=f"{param}.{i}",
                    )
        counts = self.count_items(inputs)
        limit = self.card.max_model_len
        truncating = options.get("truncate_prompt_tokens") is not None
        for i, n in enumerate(counts):
            if limit and n > limit and not truncating:
                raise DomainError(
                    Kind.INVALID,
                    "context_length_exceeded",
                    f"{param}.{i}: the input is {n} tokens, over this model's limit of {limit} "
                    "(pooling.truncate_prompt_tokens asks to cut it)",
                    param=f"{param}.{i}",
                )
        total = sum(counts) if not truncating else sum(min(n, limit or n) for n in counts)
        most = get_settings().pool_max_request_tokens
        if total > most:
            raise DomainError(
                Kind.INVALID,
                "too_many_tokens",
                f"{param}: {total} tokens in one request, over the limit of {most}",
                param=param,
            )
        return total

    def vocabulary(self) -> int | None:
        """How many token ids the model has (None: any id goes, as with the word counter)."""
        return None if self._tokenizer is None else self._tokenizer.get_vocab_size()


_lock = threading.Lock()
# Parsed tokenizers by their content's digest: the same bytes whatever Redis they came from.
_tokenizers: dict[str, Tokenizer] = {}


def _cards() -> dict[str, tuple[float, Counter | None]]:
    """model -> (when read, its counter): held with this process's Redis clients."""
    return clients.held("tokens.cards", dict)


def counter(client: redis.Redis, model: str) -> Counter | None:
    """The counter of ``model``'s published card; None when there is none to use."""
    now = time.monotonic()
    cards = _cards()
    with _lock:
        cached = cards.get(model)
    if cached is not None and now - cached[0] < CARD_CACHE_S:
        return cached[1]
    found = _load(client, model)
    with _lock:
        cards[model] = (now, found)
    return found


def _load(client: redis.Redis, model: str) -> Counter | None:
    try:
        raw = client.get(CARD_KEY_PREFIX + model)
        if raw is None:
            return None
        card = ModelCard(**json.loads(raw))
        if card.tokenizer == WORDS:
            return Counter(card, None)
        if not card.tokenizer.startswith("sha256:"):
            return None
        digest = card.tokenizer.removeprefix("sha256:")
        tokenizer = _tokenizers.get(digest)
        if tokenizer is None:
            source = client.get(TOKENIZER_KEY_PREFIX + digest)
            if source is None:
                return None
            from tokenizers import Tokenizer  # here: a process that counts no prompt skips it

            tokenizer = Tokenizer.from_str(source.decode() if isinstance(source, bytes) else source)
            # A model's tokenizer.json may pad or truncate (sentence-transformers' often pad to
            # a fixed length): a count is of the text's own tokens, as the engine sees them.
            tokenizer.no_padding()
            tokenizer.no_truncation()
            with _lock:
                if len(_tokenizers) >= MAX_TOKENIZERS:  # models come and go: keep a few
                    _tokenizers.pop(next(iter(_tokenizers)))
                _tokenizers[digest] = tokenizer
        return Counter(card, tokenizer)
    except redis.RedisError:
        return None
    except Exception:
        # A card this API cannot read (say, a newer tokenizers format) must not refuse work:
        # the engine still checks every prompt.
        log.warning("cannot use the model card of %s; prompts go unchecked", model, exc_info=True)
        return None


def check(
    client: redis.Redis,
    models: Sequence[str],
    bodies: Sequence[JobCreate],
    field: str | None = None,
) -> list[int]:
    """Prompt tokens of each body, counted for its model (``models[i]`` runs ``bodies[i]``, as
    the job names it: an adapter counts as its base); refuses the first that leaves no room in
    its model's context.

    ``field`` names the list the bodies came in (``jobs``: the error names ``jobs.3.prompt``).
    Without a card the counts are estimates (four characters a token) and nothing is refused.
    """
    # A LoRA adapter runs in its base model's context, with its tokenizer: the base's card.
    settings = get_settings()
    counters = {model: counter(client, settings.base_of(model)) for model in set(models)}
    counts = []
    for index, (model, body) in enumerate(zip(models, bodies, strict=True)):
        found = counters[model]
        if found is None:
            counts.append(estimate(body))
            continue
        if body.chosen() == "auto" and found.card.tool_parser is None:
            param = _param(field, index, "tool_choice")
            raise DomainError(
                Kind.MALFORMED,
                "tools_not_supported",
                f"{param} auto (the default with tools) needs the model's tool "
                "parser, and its workers have none (INFERQ_TOOL_CALL_PARSER); tool_choice "
                "required or a named function works without one",
                param=param,
            )
        if body.kind != "generate":
            inputs = body.pooled_inputs()
            assert inputs is not None
            param = _param(field, index, _input_of(body))
            counts.append(found.check_inputs(inputs, body.pooling_options(), param))
            continue
        several = len(body.prompts()) > 1
        vocabulary = found.vocabulary()
        for i, prompt in enumerate(body.prompts()):
            if vocabulary is not None and isinstance(prompt, list) and max(prompt) >= vocabulary:
                param = _param(field, index, f"prompt.{i}" if several else "prompt")
                raise DomainError(
                    Kind.INVALID,
                    "invalid_token_ids",
                    f"{param}: token ids must be below the model's vocabulary of {vocabulary}",
                    param=param,
                )
        limit = found.card.max_model_len
        each = found.counts(body)
        for i, n in enumerate(each):
            # vLLM's rule: the context holds the prompt and at least one generated token.
            if limit and n >= limit:
                name = "messages" if body.messages is not None else "prompt"
                param = _param(field, index, f"{name}.{i}" if several else name)
                raise DomainError(
                    Kind.INVALID,
                    "context_length_exceeded",
                    f"{param}: the prompt is at least {n} tokens; this model's context of "
                    f"{limit} tokens must also hold the output",
                    param=param,
                )
        _prompt_logprobs_bound(body, each, _param(field, index, "prompt_logprobs"))
        counts.append(sum(each))
    return counts


def _prompt_logprobs_bound(body: JobCreate, counts: list[int], param: str) -> None:
    """A result is one row and one relay message: a long prompt's logprobs, kept by each of
    its ``n`` choices, count against INFERQ_MAX_LOGPROB_ENTRIES with the output's."""
    top = body.params.prompt_logprobs_asked()
    if top is None:
        return
    settings = get_settings()
    output = body.most_output_tokens() * (1 + (body.params.logprobs or 0))
    entries = sum(counts) * body.params.n * (1 + top) + output
    if entries > settings.max_logprob_entries:
        raise DomainError(
            Kind.INVALID,
            "result_too_large",
            f"{param}: the prompt's and the output's log-probabilities would be {entries} "
            f"entries, over the limit of {settings.max_logprob_entries} a job may return "
            "(INFERQ_MAX_LOGPROB_ENTRIES)",
            param=param,
        )


def _input_of(body: JobCreate) -> str:
    return "input" if body.input is not None else "documents"


def _param(field: str | None, index: int, name: str) -> str:
    """``name`` of the body at ``index`` of ``field`` (``jobs.3.prompt``), or of the body."""
    return f"{field}.{index}.{name}" if field else name


def estimate(body: JobCreate) -> int:
    """Prompt tokens when no tokenizer is published: about four characters each."""
    pooled = body.pooled_inputs()
    if isinstance(pooled, dict):
        chars = sum(map(len, pooled["documents"])) + len(pooled["documents"]) * max(
            map(len, pooled["queries"])
        )
    elif pooled is not None:
        return sum(math.ceil(len(i) / 4) if isinstance(i, str) else len(i) for i in pooled)
    elif body.messages is not None:
        chars = sum(len(m.text()) for m in body.messages) + 16 * len(body.messages)
    else:
        prompts = body.prompts()
        return sum(math.ceil(len(p) / 4) if isinstance(p, str) else len(p) for p in prompts)
    return math.ceil(chars / 4)


# --- vLLM's /tokenize and /detokenize (app/api/tokenize.py) ---

# The simulated engine's words (workers/engines/simulated.py writes them) and its vocabulary,
# each word once: its word model's token id i is SIM_VOCABULARY[i % len(SIM_VOCABULARY)], in
# the engine and here (one definition for both).
SIM_WORDS = tuple(
    (
        "the queue holds every job until a worker with free capacity claims it and the "
        "engine batches many sequences in each step so that bulk work keeps the accelerator "
        "busy while realtime requests still start within milliseconds because lanes are "
        "served in strict priority order and leases make sure nothing is lost when a "
        "process dies"
    ).split()
)
SIM_VOCABULARY = tuple(dict.fromkeys(SIM_WORDS))
_SIM_IDS = {word: i for i, word in enumerate(SIM_VOCABULARY)}
_MAX_TOKEN_ID = 2**32 - 1  # the tokenizers library's ids are 32 bits


def sim_token_id(word: str) -> int:
    """A word's id in the simulated word model: its place in the vocabulary, else a stable one
    past it (which decodes as a word of the vocabulary)."""
    found = _SIM_IDS.get(word)
    if found is not None:
        return found
    digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
    return len(SIM_VOCABULARY) + int.from_bytes(digest, "big")


def sim_decode(ids: Sequence[int]) -> str:
    """Token ids of the simulated word model as text: their words, one space apart."""
    return " ".join(SIM_VOCABULARY[i % len(SIM_VOCABULARY)] for i in ids)


def encode(
    found: Counter, text: str, add_special_tokens: bool = True
) -> tuple[list[int], list[str]]:
    """``text``'s token ids as the model's engine tokenizes a prompt (with the tokenizer's
    special tokens unless ``add_special_tokens`` is false), and each id's token string (vLLM's
    ``convert_ids_to_tokens``). The simulated word model: one id per word or punctuation mark,
    as count_words counts them (no special tokens)."""
    if found._tokenizer is None:
        ids = [sim_token_id(word) for word in _WORD_RE.findall(text)]
        return ids, [SIM_VOCABULARY[i % len(SIM_VOCABULARY)] for i in ids]
    encoding = found._tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(encoding.ids), list(encoding.tokens)


def decode(found: Counter, ids: Sequence[int]) -> str:
    """The text of token ids, special tokens included (vLLM's ``tokenizer.decode(ids)``); an id
    the tokenizer does not have decodes to nothing, as the tokenizers library decodes it. The
    simulated word model: its words, one space apart, as the engine writes them."""
    if found._tokenizer is None:
        return sim_decode(ids)
    known = [i for i in ids if 0 <= i <= _MAX_TOKEN_ID]
    return str(found._tokenizer.decode(known, skip_special_tokens=False))
