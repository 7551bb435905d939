"""The `inferq` command: run the stack or its parts, and talk to a running API.

Flags become ``INFERQ_*`` variables for the processes they start, so settings have one source.
Worker processes are started as ``python -m workers.inference`` and ``python -m workers.ops``,
the benchmark as ``python -m bench``: nothing in ``app`` imports the workers or the bench.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from app.core.settings import DEMO_ADAPTER_NAME, LANES, get_settings

if TYPE_CHECKING:
    import httpx

ENGINES = click.Choice(["auto", "vllm", "hf", "simulated"])


def _set_env(**values: object) -> None:
    for name, value in values.items():
        if value is not None:
            os.environ[f"INFERQ_{name.upper()}"] = str(value)
    get_settings.cache_clear()


# The commands that read a running stack: run in its directory, they adopt the settings
# `inferq up` wrote there (app/cli/where.py), under the environment's.
ADOPTING = frozenset({"status", "submit", "get", "keys", "webhooks"})
# Of those, the ones that write to the database: a SQLite file that is not there is named, not
# created empty (`inferq status` says the same its own way).
NEEDING_DATABASE = frozenset({"keys", "webhooks"})


class _Inferq(click.Group):
    """The command group; an API, database or Redis that a command could not reach is one line
    naming the URL it tried and the setting that chose it, not a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        from app.cli import where

        try:
            return super().invoke(ctx)
        except Exception as exc:
            line = where.unreachable(exc)
            if line is None:
                raise
            raise click.ClickException(line) from None


@click.group(cls=_Inferq)
@click.pass_context
def main(ctx: click.Context) -> None:
    """inferq: durable, prioritised LLM inference jobs."""
    from app.cli import where

    try:
        if ctx.invoked_subcommand in ADOPTING:
            where.adopt()
        get_settings()
    except ValidationError as exc:
        # A bad combination (timing invariants, unknown lanes, ...) refuses to start, saying why.
        problems = [
            f"  {'.'.join(map(str, e['loc'])) or 'settings'}: "
            + str(e["msg"]).removeprefix("Value error, ")
            for e in exc.errors()
        ]
        raise click.ClickException("invalid settings:\n" + "\n".join(problems)) from None
    if ctx.invoked_subcommand in NEEDING_DATABASE:
        why = where.no_database(str(ctx.invoked_subcommand))
        if why is not None:
            raise click.ClickException(why)


@main.command()
@click.option(
    "--engine",
    type=ENGINES,
    default=None,
    help="Worker engine (default: INFERQ_ENGINE, else the best installed).",
)
@click.option("--concurrency", type=int, default=None, help="Jobs the worker holds at once.")
def up(engine: str | None, concurrency: int | None) -> None:
    """Run the whole stack locally on embedded defaults (Ctrl-C stops it)."""
    from app.cli.stack import Stack

    settings = get_settings()
    if not settings.model and not settings.adapters:
        # Two models on the demo: the demo model and a LoRA adapter of it (docs/scheduling.md,
        # "Many models"); every child (API, worker, ops) reads the same registration.
        adapters = {DEMO_ADAPTER_NAME: settings.demo_adapter.model_dump()}
        _set_env(adapters=json.dumps(adapters))
        settings = get_settings()
    sys.exit(Stack(settings, engine or settings.engine, concurrency).run())


@main.command()
@click.option("--host", default=None, help="Bind address (default INFERQ_API_HOST).")
@click.option("--port", type=int, default=None, help="Port (default INFERQ_API_PORT).")
@click.option("--workers", type=int, default=1, help="uvicorn worker processes.")
def api(host: str | None, port: int | None, workers: int) -> None:
    """Run the HTTP API (uvicorn)."""
    import uvicorn

    _set_env(api_host=host, api_port=port)
    settings = get_settings()
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Several processes answer /metrics: each keeps its counters in files here and a
        # scrape merges them (app/api/metrics.py). A fresh directory per start: stale files from
        # an earlier run would be counted again.
        metrics_dir = settings.data_dir / "prometheus" / f"api-{settings.api_port}"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    uvicorn.run(
        "app.api.main:create_app",
        factory=True,
        host=settings.api_host,
        port=settings.api_port,
        workers=workers,
        log_level="info",
        timeout_graceful_shutdown=10,
    )


@main.command()
@click.option("--engine", type=ENGINES, default=None)
@click.option("--lanes", default=None, help=f"Comma-separated lanes (default: {','.join(LANES)}).")
@click.option("--concurrency", type=int, default=None, help="Jobs held at once (threads).")
@click.option("--batching", type=click.Choice(["continuous", "micro"]), default=None)
@click.option(
    "--gpus", default=None, help="Comma-separated GPU ids: one worker per GPU (INFERQ_WORKER_GPUS)."
)
def worker(
    engine: str | None,
    lanes: str | None,
    concurrency: int | None,
    batching: str | None,
    gpus: str | None,
) -> None:
    """Run an inference worker: one engine, fed by every Celery thread (one per GPU with
    --gpus)."""
    _set_env(
        engine=engine,
        worker_lanes=lanes,
        worker_concurrency=concurrency,
        batching=batching,
        worker_gpus=gpus,
    )
    # Fail here, with a clear message, on a bad setting.
    module = "workers.inference.gpus" if get_settings().gpus else "workers.inference"
    os.execv(sys.executable, [sys.executable, "-m", module])  # noqa: S606


@main.command()
@click.option("--concurrency", type=int, default=None, help="Deliveries made at once.")
@click.option(
    "--beat/--no-beat", default=None, help="Run Celery beat here (default INFERQ_OPS_BEAT: yes)."
)
@click.option(
    "--dispatch/--no-dispatch",
    default=None,
    help="Run the dispatcher's loop here (default INFERQ_OPS_DISPATCH: yes).",
)
def ops(concurrency: int | None, beat: bool | None, dispatch: bool | None) -> None:
    """Run the ops worker: webhook delivery, periodic sweeps, Celery beat and the dispatcher."""
    _set_env(
        ops_concurrency=concurrency,
        ops_beat=None if beat is None else str(beat).lower(),
        ops_dispatch=None if dispatch is None else str(dispatch).lower(),
    )
    get_settings()
    os.execv(sys.executable, [sys.executable, "-m", "workers.ops"])  # noqa: S606


@main.command()
@click.option(
    "--policy",
    type=click.Choice(["fair", "arrival"]),
    default=None,
    help="Order of waiting jobs (default INFERQ_DISPATCH_POLICY: fair).",
)
def dispatch(policy: str | None) -> None:
    """Run the dispatcher: it sends waiting jobs to their queues in fair order."""
    _set_env(dispatch_policy=policy)
    get_settings()
    os.execv(sys.executable, [sys.executable, "-m", "app.dispatcher"])  # noqa: S606


@main.command()
@click.option("--address", default=None, help="Bind address (default INFERQ_FLOWER_ADDRESS).")
@click.option("--port", type=int, default=None, help="Port (default INFERQ_FLOWER_PORT).")
def flower(address: str | None, port: int | None) -> None:
    """Run Flower, the Celery dashboard, on our broker and queues (basic auth beyond loopback)."""
    _set_env(flower_address=address, flower_port=port)
    get_settings()
    os.execv(sys.executable, [sys.executable, "-m", "workers.flower"])  # noqa: S606


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    add_help_option=False,
)
@click.pass_context
def bench(ctx: click.Context) -> None:
    """Run the benchmark scenarios (`inferq bench --help` for options)."""
    # A package of its own beside app/ and workers/ (docs/architecture.md), not in the images.
    if importlib.util.find_spec("bench") is None:
        raise click.ClickException(
            "inferq bench runs from a checkout of inferq (bench/ is not installed here, "
            "e.g. in the container images): .ci/install, then .venv/bin/inferq bench"
        )
    argv = [sys.executable, "-m", "bench", *ctx.args]
    os.execv(sys.executable, argv)  # noqa: S606


@main.command()
@click.option(
    "--operator-key-env",
    "variable",
    default=None,
    help="Then store the key this environment variable holds (a Secret's value) as an "
    "operator key, unless it is stored already: the Helm chart's first key. An environment "
    "variable, never an argument, which `ps` and shell histories show; it is never printed.",
)
@click.option("--operator-tenant", default="operator", show_default=True)
def migrate(variable: str | None, operator_tenant: str) -> None:
    """Create or upgrade the database schema."""
    from app.core.db import migrate as run

    run()
    click.echo(f"database at head: {get_settings().sqlalchemy_url}")
    if variable is None:
        return
    from app.core.db import session_scope
    from app.core.tenants.keys import ensure_key

    plaintext = os.environ.get(variable, "")
    if not plaintext:
        raise click.UsageError(f"{variable} is empty or not set")
    with _refused(), session_scope() as session:
        row, created = ensure_key(
            session, operator_tenant, plaintext, "first operator key", operator=True
        )
        what = "stored" if created else "already stored"
        click.echo(f"operator key {row.id} ({row.prefix}...) of tenant {row.tenant}: {what}")


@main.group()
def keys() -> None:
    """Manage API keys (directly in the database)."""


@keys.command("create")
@click.option("--tenant", required=True)
@click.option("--name", default="")
@click.option("--rpm", type=click.IntRange(min=0), help="Requests per window (0: no limit).")
@click.option("--tpm", type=click.IntRange(min=0), help="Tokens per window (0: no limit).")
@click.option("--max-queued", type=click.IntRange(min=0), help="Jobs queued at once.")
@click.option(
    "--weight",
    type=click.FloatRange(min=0, min_open=True, max=1e6),
    help="The tenant's weight in each lane's fair share (default 1).",
)
@click.option(
    "--admin",
    is_flag=True,
    help="An operator's key: the console (/console) shows it every tenant (docs/console.md).",
)
def keys_create(
    tenant: str,
    name: str,
    rpm: int | None,
    tpm: int | None,
    max_queued: int | None,
    weight: float | None,
    admin: bool,
) -> None:
    """Create a key; it is printed once and only its hash is stored.

    Limits not given are the settings' defaults (INFERQ_TENANT_*). A tenant weighs as its
    heaviest live key: with weights 3 and 1, two tenants that both keep jobs waiting in a
    lane get 3/4 and 1/4 of its tokens.
    """
    from app.core.db import session_scope
    from app.core.tenants.keys import create_key

    with session_scope() as session:
        row, plaintext = create_key(
            session,
            tenant,
            name,
            requests_per_minute=rpm,
            tokens_per_minute=tpm,
            max_queued=max_queued,
            weight=weight,
            operator=admin,
        )
    click.echo(plaintext)
    click.echo(
        f"id {row.id}  tenant {tenant}  (store the key now: only its hash is kept)", err=True
    )


@keys.command("list")
@click.option("--tenant", default=None)
def keys_list(tenant: str | None) -> None:
    """List keys (ids and prefixes, never the keys)."""
    from sqlalchemy import select

    from app.core.db import session_scope
    from app.core.models import ApiKey

    with session_scope() as session:
        query = select(ApiKey).order_by(ApiKey.created_at)
        if tenant:
            query = query.where(ApiKey.tenant == tenant)
        for row in session.scalars(query):
            state = "revoked" if row.revoked_at else "active"
            own = {
                "rpm": row.requests_per_minute,
                "tpm": row.tokens_per_minute,
                "max-queued": row.max_queued,
                "weight": row.weight,
            }
            overrides = " ".join(f"{k}={v}" for k, v in own.items() if v is not None)
            if row.operator:
                overrides += " operator"
            click.echo(
                f"{row.id}  {row.tenant:<16} {row.prefix}...  {state:<8} {row.name} {overrides}"
            )


@keys.command("revoke")
@click.argument("key_id")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by id."""
    from app.core.db import session_scope
    from app.core.tenants.keys import revoke_key

    with session_scope() as session:
        done = revoke_key(session, key_id)
    click.echo("revoked" if done else "no such active key")
    sys.exit(0 if done else 1)


@main.group()
def tenant() -> None:
    """What a deployment keeps for a tenant beyond its keys (directly in the database)."""


@tenant.command("retention")
@click.argument("name")
@click.option(
    "--days",
    type=click.FloatRange(min=0),
    default=None,
    help="Keep the tenant's finished jobs this long after they end (0: forever).",
)
@click.option("--default", "use_default", is_flag=True, help="Back to INFERQ_JOB_RETENTION_S.")
def tenant_retention(name: str, days: float | None, use_default: bool) -> None:
    """Show or set how long a tenant's finished jobs are kept (docs/api.md, "What is kept")."""
    from app.core.db import session_scope
    from app.core.lifecycle import retention

    if days is not None and use_default:
        raise click.UsageError("give --days or --default, not both")
    with _refused(), session_scope() as session:
        if days is not None:
            retention.set_retention(session, name, round(days * 86400))
        elif use_default:
            retention.set_retention(session, name, None)
        found = retention.kept(session, name)
    seconds = found.retention_s
    kept = f"{seconds / 86400:g} days ({seconds} s)" if seconds else "forever"
    deleted = found.swept_through or "-"
    click.echo(f"tenant {name}: finished jobs kept {kept}; deleted through {deleted}")


@contextlib.contextmanager
def _refused() -> Iterator[None]:
    """A refusal from the core (a bad URL, an unknown id) as a one-line error, exit code 1."""
    from app.core.errors import DomainError

    try:
        yield
    except DomainError as exc:
        raise click.ClickException(f"{exc.code}: {exc.message}") from None


@main.group()
def webhooks() -> None:
    """Manage a tenant's webhook endpoints: OpenAI-format events signed with the endpoint's own
    secret (directly in the database; tenants use POST /v1/webhook_endpoints)."""


@webhooks.command("add")
@click.option("--tenant", required=True)
@click.option(
    "--events",
    required=True,
    help="Comma-separated event types, e.g. batch.completed,batch.failed.",
)
@click.option("--name", default="", help="A name for the endpoint (default: its URL).")
@click.argument("url")
def webhooks_add(tenant: str, events: str, name: str, url: str) -> None:
    """Register URL for the tenant's events; the signing secret is printed once."""
    from app.core.db import session_scope
    from app.core.webhooks import endpoints

    types = [t.strip() for t in events.split(",") if t.strip()]
    with _refused(), session_scope() as session:
        row = endpoints.create(session, tenant, name=name or url, url=url, event_types=types)
        shown = (row.id, row.secret, row.event_types)
    click.echo(shown[1])
    click.echo(
        f"id {shown[0]}  tenant {tenant}  events {shown[2]}  "
        "(store the secret now: it is not shown again)",
        err=True,
    )


@webhooks.command("list")
@click.option("--tenant", required=True)
def webhooks_list(tenant: str) -> None:
    """List a tenant's endpoints (ids, URLs and event types; never the secrets)."""
    from app.core.db import session_scope
    from app.core.webhooks import endpoints

    with session_scope() as session:
        after = None
        while True:
            rows, more = endpoints.list_page(session, tenant, limit=100, after=after)
            for row in rows:
                click.echo(f"{row.id}  {row.url}  {row.event_types}  {row.name}")
            if not more:
                break
            after = rows[-1].id


@webhooks.command("remove")
@click.option("--tenant", required=True)
@click.argument("endpoint_id")
def webhooks_remove(tenant: str, endpoint_id: str) -> None:
    """Remove an endpoint and its events."""
    from app.core.db import session_scope
    from app.core.webhooks import endpoints

    with _refused(), session_scope() as session:
        endpoints.delete(session, tenant, endpoint_id)
    click.echo("removed")


def _client() -> httpx.Client:
    # Imported here, as each command's own parts are: `inferq status` starts without it.
    import httpx

    settings = get_settings()
    headers = {}
    if settings.api_key is not None:
        headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    return httpx.Client(base_url=settings.base_url, headers=headers, timeout=30)


def _show(response: httpx.Response, echo: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = response.json()
    if echo or response.status_code >= 400:
        click.echo(json.dumps(body, indent=2))
    if response.status_code >= 400:
        sys.exit(1)
    return body


@main.command()
@click.argument("prompt")
@click.option("--lane", type=click.Choice(LANES), default="standard")
@click.option("--max-tokens", type=int, default=None)
@click.option("--temperature", type=float, default=None)
@click.option("--chat", is_flag=True, help="Send the prompt as one user chat message.")
@click.option("--wait", is_flag=True, help="Poll until the job finishes.")
def submit(
    prompt: str,
    lane: str,
    max_tokens: int | None,
    temperature: float | None,
    chat: bool,
    wait: bool,
) -> None:
    """Submit a job to the API at INFERQ_API_URL (key from INFERQ_API_KEY)."""
    body: dict[str, Any] = {"lane": lane, "params": {}}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if max_tokens is not None:
        body["params"]["max_tokens"] = max_tokens
    if temperature is not None:
        body["params"]["temperature"] = temperature
    with _client() as client:
        job = _show(client.post("/v1/jobs", json=body), echo=not wait)
        while wait and job["status"] in ("queued", "running"):
            time.sleep(0.2)
            job = _show(client.get(f"/v1/jobs/{job['id']}"), echo=False)
        if wait:
            click.echo(json.dumps(job, indent=2))


@main.command()
@click.argument("job_id")
def get(job_id: str) -> None:
    """Print a job."""
    with _client() as client:
        _show(client.get(f"/v1/jobs/{job_id}"))


@main.command("status")
@click.option("--watch", is_flag=True, help="Keep refreshing until Ctrl-C.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds between refreshes with --watch.",
)
@click.option(
    "--no-api",
    is_flag=True,
    help="Read Redis and the database here (the ones the settings name), without asking the API.",
)
def status_command(watch: bool, interval: float, no_api: bool) -> None:
    """Lanes, workers and the last minute's throughput: the API's snapshot (GET
    /v1/admin/status), or read from Redis and the database where no API answers."""
    # Most of what this command takes is importing what it reads with (docs/benchmarks.md,
    # "`inferq status`"): the collector would walk the objects they make over and over while they
    # load, and once more at exit; it waits until they are in, then leaves them out for good.
    collecting = gc.isenabled()
    gc.disable()
    try:
        from app.cli.status import run
    finally:
        gc.freeze()
        if collecting:
            gc.enable()
    sys.exit(run(watch=watch, interval=interval, ask_api=not no_api))


if __name__ == "__main__":
    main()
