"""Tandem's settings: read once, from ``TANDEM_*`` environment variables (or CLI flags)."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from gateway.catalog import WorkerUrl
from gateway.client_address import parse_trusted_proxies
from kv_transfer.connector import DEFAULT_KV_LEASE_S, ConnectorConfig
from workers.vllm_busy_wait import DEFAULT_PAUSE_US, MAX_PAUSE_US


class RemoteModerationSettings(BaseModel):
    """One remote ``/v1/moderations`` server (see ``moderation.remote.RemoteProviderConfig``)."""

    model_config = ConfigDict(extra="forbid")

    url: str
    model: str | None = None
    api_key: SecretStr | None = None
    timeout_s: float = Field(2.0, gt=0)
    on_failure: Literal["open", "closed"] = "open"
    threshold: float | None = Field(None, ge=0, le=1)


class TandemSettings(BaseSettings):
    """Everything an operator can set. Components receive small frozen configs built from it."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_", extra="ignore")

    host: str = "127.0.0.1"
    """Address the gateway listens on."""
    port: int = Field(8000, ge=1, le=65535)
    """Port the gateway listens on."""

    gateway_workers: int | None = Field(None, ge=1)
    """Gateway processes serving ``host:port`` together (``SO_REUSEPORT``: the kernel spreads
    connections). Unset: the cores available to ``tandem up`` minus those its managed workers
    are bound to (``cpu_binding``), at least 1; 1 with the planner on (it reads one process's
    load, so it refuses more). Above 1 they share every store through Redis
    (``redis_url``, else a ``redis-server`` ``tandem up`` starts and owns); see
    ``docs/ARCHITECTURE.md``, "Gateway processes"."""
    gateway_process_base_port: int | None = Field(None, ge=1, le=65535)
    """With several gateway processes, each also serves on ``127.0.0.1`` alone (its own
    ``/metrics``): process ``i`` on this port + ``i``; unset = free ports, listed in
    ``state_dir/gateway-processes.json``."""

    model: Path | None = None
    """Model to serve: a GGUF file or HF-format folder; unset = bundled SmolLM2-135M-Instruct."""
    config: Path | None = None
    """A file (TOML or YAML) declaring several versions, their workers and traffic policies
    (``gateway/assembly/config_file.py``); unset = one version from ``model`` and the worker
    counts below."""
    served_model_name: str | None = None
    """Name clients put in ``model``; default derived from the model."""
    cache_dir: Path | None = None
    """Where prepared models live; default ``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``."""
    log_dir: Path = Path(".tandem/logs")
    """Where each managed worker's output goes (one file per worker)."""

    num_prefill_workers: int = Field(1, ge=0)
    """Managed prefill workers to launch (0 when only external ones are used)."""
    num_decode_workers: int = Field(1, ge=0)
    """Managed decode workers to launch."""
    prefill_urls: Annotated[list[WorkerUrl], NoDecode] = Field(default_factory=list)
    """Base URLs of prefill workers someone else started (GPUs, other hosts)."""
    decode_urls: Annotated[list[WorkerUrl], NoDecode] = Field(default_factory=list)
    """Base URLs of decode workers someone else started."""
    tokenizer_dir: Path | None = None
    """A folder with the served model's ``tokenizer.json``, for a model with no folder here
    (only external workers): admission counts prompts with it. Unset: the model's own folder,
    else 4 characters a token (an estimate that settling against the engine's usage
    corrects, but a quota reserves what it says)."""
    worker_host: str = "127.0.0.1"
    """Interface managed workers bind to (HTTP and the NIXL side channel)."""
    prefill_base_port: int = Field(8100, ge=1, le=65535)
    """HTTP port of the first managed prefill worker; the next ones count up."""
    decode_base_port: int = Field(8200, ge=1, le=65535)
    """HTTP port of the first managed decode worker; the next ones count up."""
    side_channel_base_port: int = Field(5600, ge=1, le=65535)
    """NIXL side-channel port of the first managed worker; each worker gets its own."""
    cpu_binding: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["0", "1"])
    """OpenMP thread binding per managed worker (prefill ones first), e.g. ``0`` and ``1``."""
    worker_busy_wait_pause_us: int = Field(DEFAULT_PAUSE_US, ge=0, le=MAX_PAUSE_US)
    """How a managed worker's vLLM processes wait for each other's next message in the second
    after the last one: sleeping this many µs between looks instead of spinning, so the one
    waited for gets the core (``workers/vllm_busy_wait.py``); 0 keeps vLLM's spin."""
    kv_cache_gib: int = Field(1, ge=1)
    """KV cache per CPU worker, in GiB (vLLM's ``VLLM_CPU_KVCACHE_SPACE``)."""
    kv_block_size: int = Field(128, ge=1)
    """Tokens per KV block (vLLM's ``--block-size``; 128 is vLLM's own on CPU, 16 on GPUs).
    Managed workers get it; set it to external workers' value so the KV bytes each request
    hands over can be counted."""
    max_model_len: int | None = Field(None, ge=16)
    """Context window the workers serve; unset = the model's own."""
    worker_extra_args: str = ""
    """Further vLLM flags for every managed worker, split like a shell line and appended
    last (e.g. ``--num-gpu-blocks-override 9`` to make KV scarce and see preemptions)."""
    worker_command: str = ""
    """The program a managed worker runs, split like a shell line; it gets vLLM's OpenAI
    server flags. Empty: vLLM's server (``python -m vllm.entrypoints.openai.api_server``). A
    wrapper of it (a profiler, a patched build) goes here; so does the fast test tier's fake
    engine."""
    default_max_tokens: int = Field(1024, ge=0)
    """Output cap of a chat request that sets no ``max_tokens`` (a plan's ``max_output_tokens``
    wins), listed in ``/v1/models``; 0 = none, up to the context window as OpenAI's API."""
    enforce_eager: bool = False
    """Skip graph compilation: boots in ~50 s instead of ~2 min, decodes somewhat slower."""
    dtype: str = "float32"
    """Worker dtype. float32 by default: measured on vllm-cpu 0.32, SmolLM2-135M in bf16 answers
    greedy prompts with fluent nonsense where fp32 (and transformers in bf16) answer correctly."""
    kv_lease_s: int = Field(DEFAULT_KV_LEASE_S, ge=1)
    """How long a prefill worker keeps KV that no decode worker has read (client gone between
    the legs); decode renews it while reading. vLLM's default is 30 s."""
    nixl_progress_delay_us: int = Field(1000, ge=0)
    """Poll timeout of each worker's NIXL progress thread, in µs. 0 is NIXL's own: a busy poll
    that keeps a whole core at 100 % on every idle worker."""
    nixl_thread_nice: int = Field(19, ge=0, le=19)
    """Nice value of the threads NIXL starts in each managed worker: 19 lets the model's
    thread, which does the KV copy, keep its core; 0 leaves them at the worker's."""
    ucx_transports: str | None = None
    """The managed workers' ``UCX_TLS`` for KV transfers, e.g. ``cma,tcp``; unset leaves UCX's
    default, which picks per pair of workers (CMA on one host, RDMA or TCP across hosts;
    ``kv_transfer/connector.py``). Shared-memory transports alone are refused: NIXL's messages
    need ``tcp`` or an RDMA transport."""
    worker_ready_timeout_s: float = Field(600.0, gt=0)
    """How long ``tandem up`` waits for every worker to become healthy."""

    connect_timeout_s: float = Field(5.0, gt=0)
    """Time to open a connection to a worker before it counts as unreachable."""
    prefill_timeout_s: float = Field(120.0, gt=0)
    """Whole-leg time limit for the prefill leg (it returns one token)."""
    decode_idle_timeout_s: float = Field(120.0, gt=0)
    """Longest wait for the next byte from a decode worker before the request fails."""
    disaggregate_min_prompt_tokens: int = Field(256, ge=0)
    """Prompts estimated shorter than this run colocated on a decode worker (0: always split).
    Splitting adds a hop and a KV transfer to time to first token; short prompts gain nothing."""
    interference_budget: int = Field(0, ge=0)
    """Split a prompt under ``disaggregate_min_prompt_tokens`` anyway once prompt tokens x the
    requests in flight on its decode worker reach this (the token-streams its colocated prefill
    would stall); 0: never. Off by default: on the 2-core CPU machine split legs under a flood
    ran slower than the stalls they avoid (docs/ARCHITECTURE.md, noisy neighbours)."""
    decode_step_tokens: int = Field(64, ge=0)
    """Decode workers' token budget per engine step (vLLM's ``--max-num-batched-tokens``; 0
    keeps vLLM's, 2048 on CPU): bounds how long a colocated prompt's prefill holds up every running
    stream and a newcomer's first token. 64 fits a short chat prompt plus the running streams'
    next tokens in one step. Prefill workers keep vLLM's default."""
    decode_first_byte_timeout_s: float = Field(30.0, gt=0)
    """Longest wait for a decode stream's first token (KV transfer included); past it the
    request is re-run colocated on a decode worker."""
    sse_ping_interval_s: float = Field(15.0, ge=0)
    """Heartbeat comment interval on client streams (0: none). A stream whose request is still
    queued or prefilling after one interval starts anyway, with a heartbeat, so clients and
    proxies with idle timeouts keep it open."""
    access_log: bool = False
    """uvicorn's line per HTTP request. Off by default: every OpenAI request already logs one
    line of its own when it ends (``tandem.requests``: outcome, path, workers, TTFT, tokens) and
    admin changes are audited, while uvicorn writes its line before a stream's first byte (0.4 ms
    of the added time to first token at one stream, ``bench/overhead``)."""
    shutdown_grace_s: int = Field(30, ge=0)
    """On SIGTERM/SIGINT a gateway process stops accepting and gives the requests it is serving
    this long to finish; past it they are cancelled (each billed for what it produced and
    counted as aborted). Without it one idle stream kept alive by heartbeats holds a stop
    forever."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Deadline of a request without ``x-tandem-timeout-ms``, from arrival to its last byte
    (queue, prefill and decode); past it the request ends with 504 ``deadline_exceeded``."""
    max_request_timeout_s: float = Field(3600.0, gt=0)
    """The longest deadline a client may ask for with ``x-tandem-timeout-ms``."""
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest request body (4 MiB: a 128k-token prompt is about 0.5 MiB of text); a larger one
    is 413 ``body_too_large``, refused on its ``Content-Length`` before it is read."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Longest time a request's body may take to arrive after its headers; past it 408
    ``request_timeout``. The body is read whole before any route runs, so a client sending it
    byte by byte holds no admission slot meanwhile (``gateway/limits.py``)."""
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    """Largest request line plus headers; past it 431 ``headers_too_large``, counted as they
    arrive (``gateway/cli/http_protocol.py``)."""
    header_timeout_s: float = Field(30.0, gt=0)
    """Longest time from a connection opening, or the first byte of its next request, to the
    end of a request's headers; past it 408 ``request_timeout`` and the connection is closed."""
    health_interval_s: float = Field(1.0, gt=0)
    """How often each worker's ``/health`` is polled."""

    state_dir: Path = Path(".tandem")
    """Local durable state: the tenant store of the embedded default (``tandem.db``), the
    generated admin key (``admin.key``), the SQLite ledger (``ledger.db``) and the ledger's
    spool (``ledger-spool/``, records not yet in the database); the planner's worker profile
    (``profile.json``) by default."""
    redis_url: str | None = None
    """Redis for tenants, keys, quota counters and usage, shared by gateway replicas; unset =
    the embedded default (SQLite file + in-memory counters, one gateway)."""
    store_timeout_s: float = Field(2.0, gt=0)
    """Longest wait for a Redis operation before the store counts as unavailable (a whole call
    may take twice this). A refused connection fails at once; this bounds a hung Redis, and is
    generous because under a burst the gateway's own event loop, not Redis, is what is late:
    a tight limit would turn load into fail-open admissions without quota checks."""
    quota_store_failure: Literal["open", "closed"] = "open"
    """While the quota store is unreachable: admit without quota checks (``open``) or refuse
    with 503 (``closed``)."""
    admin_key: SecretStr | None = None
    """Credential of the admin API; unset = generated once and kept in ``state_dir/admin.key``."""
    auth_required: bool = True
    """Require a tenant API key on the OpenAI routes; ``false`` serves unknown callers as an
    unlimited ``anonymous`` tenant (local development only)."""
    auth_failure_limit: int = Field(10, ge=0)
    """Failed authentications (missing, unknown or revoked keys; wrong admin keys) a client
    address may make in a burst; past them it gets 429 ``too_many_auth_failures`` without its
    key being looked up, unless the key is one the gateway already verified
    (``gateway/auth_throttle.py``). Per gateway process. 0: never throttled."""
    auth_failure_window_s: float = Field(60.0, gt=0)
    """The limit refills over this time: a throttled client gets one attempt more every
    ``auth_failure_window_s / auth_failure_limit``."""
    metrics_public: bool = False
    """Anyone who reaches the port may read ``/metrics``, which shows every tenant's tokens,
    spend and budget. Off: clients on this host (local scrapers) read it freely, others need
    the admin key (``Authorization: Bearer``, as Prometheus's ``authorization`` sends it)."""
    trusted_proxies: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Proxies (addresses or networks, comma-separated: ``10.0.0.0/8,127.0.0.1``) whose
    ``X-Forwarded-For`` names the client the failed-authentication limit counts; unset: the
    connecting address is the client, and ``X-Forwarded-For`` is ignored."""
    max_queue: int = Field(1024, ge=1)
    """Requests that may wait for admission at once on this gateway; more are shed (503)."""
    max_in_flight_per_worker: int = Field(32, ge=1)
    """Requests admitted at once per healthy decode worker; the rest wait in the fair queue."""
    kv_usage_watermark: float = Field(0.95, gt=0, le=1)
    """A decode worker whose KV cache is at least this full (vLLM's ``kv_cache_usage_perc``)
    takes no new requests: they wait in the fair queue instead of making vLLM preempt, and
    admitted ones go to a decode worker under it (to the least-loaded one if none is)."""
    interactive_headroom: float = Field(0.25, ge=0, le=1)
    """Interactive-band requests may be admitted past the in-flight cap by this fraction of it
    (rounded up; none while every decode worker is KV-full): they join the engine at once and
    priority scheduling runs them first, instead of waiting for a slot behind batch work. 0
    admits every band by the same cap."""
    max_band_skips: int = Field(8, ge=0)
    """Starvation bound across bands: a waiting band is served once this many admissions in a
    row went to better bands (standard and batch progress through an interactive storm). 0
    keeps bands strict: a lower band waits until every better one is empty."""
    engine_priority: bool = True
    """Carry each tenant's band into vLLM as the request's ``priority`` (interactive -100,
    standard 0, batch 100, plus the tenant's fair position in its band, so the least served
    goes first) on both legs, with managed workers run ``--scheduling-policy priority``:
    interactive work is scheduled first inside the engine and may preempt batch work. External
    workers must run that policy too for it to matter (under vLLM's ``fcfs`` the priority is
    accepted and ignored); false sends none."""
    queue_timeout_s: float = Field(60.0, gt=0)
    """Longest a request waits for admission before a 503 with ``retry-after``."""

    rollout_tick_s: float = Field(0.25, gt=0)
    """How often the gateway holding the rollout lease walks the active rollouts (a failed
    gate's rollback is put in force within about this)."""
    rollout_lease_ttl_s: float = Field(5.0, gt=0)
    """How long a gateway that stopped renewing the rollout lease keeps it: another takes over
    within this and a third more."""
    rollout_window_bucket_s: float = Field(10.0, gt=0, le=60)
    """Resolution of the per-version windows rollout gates read: a step's window starts up to
    this long before the step (short bakes in tests want 1)."""
    rollout_prometheus_url: str | None = Field(None, pattern=r"^https?://")
    """Prometheus (``http://prometheus:9090``) scraping every gateway replica's ``/metrics``
    (15 s apart or less: a gate reads at least the last minute): rollout gates then judge all
    replicas' traffic by PromQL; unset = the embedded default, the lease holder's own windows
    (its replica's share of the traffic)."""

    planner: Literal["off", "dry-run", "local", "kubernetes"] = "off"
    """The autoscaling planner (``gateway/planning.py``): ``dry-run`` plans this gateway's pools
    every ``planner_interval_s`` and only reports (status, metrics, audit); ``local`` starts
    and drains this gateway's own vLLM workers (``tandem up``'s); ``kubernetes`` scales each
    version's prefill and decode Deployments, from the gateway holding the planner's lease. On,
    it needs a worker profile (``planner_profile``, made by ``tandem profile``): without one the
    gateway refuses to start."""
    planner_paused: bool = False
    """Start the planner paused: it steps and reports, and changes nothing until resumed
    (``tandem planner resume``)."""
    planner_profile: Path | None = None
    """The worker profile the planner sizes pools by (``tandem profile --out FILE``); unset =
    ``state_dir/profile.json``. One profile serves every version."""
    planner_interval_s: float = Field(30.0, gt=0)
    """How often the planner steps: the load it reads is the last interval's."""
    planner_ttft_target_s: float = Field(1.0, gt=0)
    """Mean time to first token the prefill pool is sized for (the SLO in
    ``deploy/prometheus``: the first token within 1 s)."""
    planner_itl_target_s: float = Field(0.1, gt=0)
    """Mean inter-token latency the decode pool is sized for (the SLO: 0.1 s a token)."""
    planner_headroom: float = Field(0.8, gt=0, le=1)
    """The share of a worker's profiled capacity the planner plans to use."""
    planner_kv_usage_target: float = Field(0.9, gt=0, le=1)
    """Mean KV-cache usage of a decode pool's workers from which the planner adds one (their
    requests then wait for memory, which the profile does not see)."""
    planner_prefill_min_replicas: int = Field(0, ge=0)
    """Fewest prefill workers per version (0: prompts then run colocated on decode workers)."""
    planner_prefill_max_replicas: int = Field(8, ge=0)
    """Most prefill workers per version."""
    planner_decode_min_replicas: int = Field(1, ge=0)
    """Fewest decode workers per version (at least 1 keeps the version serving)."""
    planner_decode_max_replicas: int = Field(8, ge=0)
    """Most decode workers per version."""
    planner_up_window_s: float = Field(0.0, ge=0)
    """A pool grows to the highest recommendation of this window (0: the latest one)."""
    planner_down_window_s: float = Field(300.0, ge=0)
    """A pool shrinks only to the highest recommendation of this window: a dip must last it."""
    planner_cooldown_s: float = Field(60.0, ge=0)
    """No shrinking within this of a pool's last change."""
    planner_tolerance: float = Field(0.1, ge=0)
    """A recommendation within this share of the current size is no change (hysteresis)."""
    planner_max_workers: int | None = Field(None, ge=0)
    """``local``: vLLM workers the planner may run on this host, every version and pool
    together (draining ones count); unset: as many as ``planner_memory_gib`` holds."""
    planner_memory_gib: float | None = Field(None, gt=0)
    """``local``: memory the workers may take; unset: 80 % of the host's."""
    planner_worker_memory_gib: float = Field(4.0, gt=0)
    """``local``: memory one worker takes (the bundled model with a 1 GiB KV cache on CPU:
    ~3.7 GB)."""
    planner_drain_timeout_s: float = Field(120.0, ge=0)
    """``local``: how long a worker being removed may finish its streams; those still running
    then end with an error event."""
    planner_namespace: str = Field("default", min_length=1)
    """Kubernetes namespace of the versions' Deployments (``planner=kubernetes``;
    ``deploy/kubernetes`` uses ``tandem``)."""

    billing: bool = True
    """Keep the usage ledger (records, budgets, exports); ``false`` switches billing off."""
    billing_database_url: SecretStr | None = None
    """PostgreSQL for a ledger shared by several gateways (``postgresql://user:pw@host/db``);
    unset = the embedded default, ``state_dir/ledger.db`` (SQLite, WAL)."""
    billing_currency: str = Field("USD", pattern=r"^[A-Z]{3}$")
    """ISO 4217 code of costs, budgets and prices."""
    billing_refresh_interval_s: float = Field(5.0, gt=0)
    """How often spend, prices and budgets are re-read from the ledger: without Redis, another
    gateway's spend counts against a shared budget here within about this long (with Redis, at
    once: ``billing/spend_sync.py``)."""
    worker_cost_per_hour: Decimal = Field(Decimal(0), ge=0)
    """What one worker's hardware costs per hour, in ``billing_currency`` (e.g. ``2.50`` for a
    cloud GPU): with measured busy time it gives the real cost per 1k tokens."""
    worker_costs_per_hour: dict[str, Decimal] = Field(default_factory=dict)
    """Per-worker hourly prices that differ, as JSON by worker name, e.g. ``{"prefill-0": 3.1}``."""
    telemetry_interval_s: float = Field(5.0, gt=0)
    """How often GPUs (NVML) or the host are sampled for the measured cost."""
    deployment: str = Field("default", min_length=1)
    """Name of this deployment (a rollout arm); ledger records and measured cost carry it."""
    model_version: str | None = None
    """The exact model version served (price cards are keyed by it); unset = the prepared
    model's folder name (name + content hash), or the served model name for external workers."""

    idempotency_retention_s: float = Field(24 * 3600.0, gt=0)
    """How long the answer to a request with an ``Idempotency-Key`` is kept for its retries."""
    moderation_rules: Path | None = None
    """JSON rules file for the built-in ``rules`` moderation provider (term lists, patterns,
    PII detectors); unset = the shipped default rules."""
    moderation_providers: dict[str, RemoteModerationSettings] = Field(default_factory=dict)
    """Remote OpenAI-compatible moderation servers by name, as JSON, e.g.
    ``{"guard": {"url": "http://guard:8000", "model": "llama-guard", "on_failure": "closed"}}``."""
    moderation_default_policy: dict[str, Any] | None = None
    """Moderation policy (JSON, as in the admin API's ``moderation`` field) of tenants that set
    none; unset = no moderation."""
    moderation_window_chars: int = Field(48, ge=1)
    """Output characters held back while streaming so a term split across chunks is caught;
    at least the longest rule. Each stream's first text is delayed by about this much."""
    moderation_batch_chars: int = Field(0, ge=0)
    """0: a moderated stream is checked at every chunk. N > 0: only once N characters can be
    released, so text goes out in bursts of at least N and the checks (a remote provider's
    calls) are about N / (characters per chunk) times fewer."""

    @field_validator("prefill_urls", "decode_urls", "cpu_binding", mode="before")
    @classmethod
    def _split_lists(cls, value: object) -> object:
        # Environment variables carry lists as comma-separated strings (a URL is then trimmed
        # and checked by WorkerUrl).
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list):
            return [str(item).strip() for item in items if str(item).strip()]
        return value

    @field_validator("trusted_proxies", mode="before")
    @classmethod
    def _split_proxies(cls, value: object) -> object:
        items = value.split(",") if isinstance(value, str) else value
        if isinstance(items, list):
            items = [str(item).strip() for item in items if str(item).strip()]
            parse_trusted_proxies(items)  # its ValueError names the entry and the fix
        return items

    @field_validator("ucx_transports")
    @classmethod
    def _usable_ucx_transports(cls, value: str | None) -> str | None:
        ConnectorConfig(ucx_transports=value)  # its ValueError names the fix
        return value

    @field_validator("tokenizer_dir")
    @classmethod
    def _has_a_tokenizer(cls, value: Path | None) -> Path | None:
        if value is not None and not (value / "tokenizer.json").is_file():
            raise ValueError(
                f"{value} has no tokenizer.json: name the served model's folder (the one "
                "with its tokenizer.json), or unset TANDEM_TOKENIZER_DIR to count 4 "
                "characters a token"
            )
        return value

    @model_validator(mode="after")
    def _planner_limits(self) -> TandemSettings:
        for pool in ("prefill", "decode"):
            low = getattr(self, f"planner_{pool}_min_replicas")
            high = getattr(self, f"planner_{pool}_max_replicas")
            if low > high:
                name = f"TANDEM_PLANNER_{pool.upper()}"
                raise ValueError(
                    f"{name}_MIN_REPLICAS ({low}) is above {name}_MAX_REPLICAS ({high}): "
                    "lower the minimum or raise the maximum"
                )
        return self
