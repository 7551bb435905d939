"""A long prompt as token ids against the same prompt as text: the API's CPU per request (issue 64).

    python -m bench.token_ids [--tokens 8000] [--rounds 6] [--block 10] [--tokenizer PATH]

One stack of real processes (bench/harness.py: API, Redis, dispatcher, one worker on the
SIMULATED engine, PostgreSQL). Each request is ``POST /v1/completions`` with ``max_tokens`` 1,
sent one at a time by one client; the same prompt goes either as its text or as its token ids
(the ids the model's tokenizer gives the text, special tokens included: what the engine sees).
The API's CPU (user + system of its process, psutil) is read around each block of ``block``
requests of one form; the blocks alternate (text, ids, text, ids ...) for ``rounds`` rounds so
that drift falls on both alike. Printed: each form's CPU per request (median over the rounds)
and the ratio ids / text (median of the rounds' ratios), then the worker's alike.

Two tokenizers, one after the other on the same stack: the simulated engine's word model (the
card it publishes; a text is counted with a regular expression) and, when ``--tokenizer`` (a
tokenizer.json; default: the demo model's in INFERQ_CACHE_DIR, if it was built) is found, that
tokenizer, published as the model's card the way a vllm worker publishes its own (the API then
tokenizes a text with it to count its tokens, and checks ids against its vocabulary).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import click
import httpx
import redis
from tokenizers import Tokenizer

from app.core.scheduling import tokens
from app.core.settings import Settings
from bench.harness import BenchStack
from bench.overhead import cpu_seconds
from workers.engines.demo import demo_model_dir
from workers.engines.simulated import VOCABULARY

MAX_MODEL_LEN = 32_768
STDLIB_TEXT = Path(json.__file__).parent.parent  # Python's own sources: text for a real BPE


def _word_prompt(n: int) -> tuple[str, list[int]]:
    text = " ".join(VOCABULARY[(i * 7919) % len(VOCABULARY)] for i in range(n))
    words = tokens.Counter(tokens.ModelCard("m", MAX_MODEL_LEN, tokens.WORDS), None)
    ids, _ = tokens.encode(words, text)
    return text, ids


def _bpe_prompt(tokenizer: Tokenizer, n: int) -> tuple[str, list[int]]:
    """About ``n`` tokens of Python's own sources, cut where the n-th token ends."""
    source = "".join(p.read_text(errors="replace") for p in sorted(STDLIB_TEXT.glob("*.py"))[:40])
    encoding = tokenizer.encode(source, add_special_tokens=False)
    text = source[: encoding.offsets[n - 1][1]]
    return text, list(tokenizer.encode(text).ids)


def _blocks(
    stack: BenchStack, model: str, forms: dict[str, Any], rounds: int, block: int
) -> dict[str, Any]:
    api = next(c for c in stack.children if c.name == "api")
    worker = next(c for c in stack.children if c.name == "worker0")
    spent: dict[str, dict[str, list[float]]] = {f: {"api": [], "worker": []} for f in forms}
    with httpx.Client(base_url=stack.url, timeout=120) as client:

        def send(prompt: Any) -> None:
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            r = client.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:300]}")

        for prompt in forms.values():  # warm-up: connections, the card, the tokenizer
            for _ in range(3):
                send(prompt)
        for _ in range(rounds):
            for form, prompt in forms.items():
                api_before, worker_before = cpu_seconds(api), cpu_seconds(worker)
                for _ in range(block):
                    send(prompt)
                spent[form]["api"].append((cpu_seconds(api) - api_before) * 1000 / block)
                spent[form]["worker"].append((cpu_seconds(worker) - worker_before) * 1000 / block)
    result: dict[str, Any] = {}
    for part in ("api", "worker"):
        per = {f: statistics.median(spent[f][part]) for f in forms}
        ratios = [i / t for i, t in zip(spent["ids"][part], spent["text"][part], strict=True)]
        result[part] = {
            "text_ms": round(per["text"], 3),
            "ids_ms": round(per["ids"], 3),
            "ids_over_text": round(statistics.median(ratios), 3),
            "ratios": [round(r, 3) for r in ratios],
        }
    return result


@click.command()
@click.option("--tokens", "n", default=8000, show_default=True, help="Prompt length in tokens.")
@click.option("--rounds", default=6, show_default=True, help="Text/ids block pairs.")
@click.option("--block", default=10, show_default=True, help="Requests per block.")
@click.option("--tokenizer", "path", type=click.Path(path_type=Path), default=None)
@click.option(
    "--postgres",
    default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    show_default=True,
)
def main(n: int, rounds: int, block: int, path: Path | None, postgres: str) -> None:
    env = {"INFERQ_ENGINE": "simulated", "INFERQ_MAX_MODEL_LEN": str(MAX_MODEL_LEN)}
    settings = Settings(engine="simulated")
    path = path or demo_model_dir(settings.cache_dir) / "tokenizer.json"
    workdir = Path(tempfile.mkdtemp(prefix="token-ids-"))
    out: dict[str, Any] = {"tokens": n, "rounds": rounds, "block": block}
    with BenchStack(postgres, env, workdir) as stack:
        stack.start()
        model = settings.model_name
        text, ids = _word_prompt(n)
        out["words"] = {"prompt_tokens": len(ids), "text_chars": len(text)}
        out["words"] |= _blocks(stack, model, {"text": text, "ids": ids}, rounds, block)
        click.echo(json.dumps({"words": out["words"]}))
        if path.exists():
            source = path.read_text()
            tokenizer = Tokenizer.from_str(source)
            tokens.publish(redis.Redis(port=stack.redis_port), model, MAX_MODEL_LEN, source)
            time.sleep(tokens.CARD_CACHE_S + 1)  # the API reads the card again
            text, ids = _bpe_prompt(tokenizer, n)
            out["bpe"] = {"tokenizer": str(path), "prompt_tokens": len(ids)}
            out["bpe"]["text_chars"] = len(text)
            out["bpe"] |= _blocks(stack, model, {"text": text, "ids": ids}, rounds, block)
            click.echo(json.dumps({"bpe": out["bpe"]}))
        else:
            click.echo(f"no tokenizer at {path}: the word model only", err=True)
    click.echo(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
