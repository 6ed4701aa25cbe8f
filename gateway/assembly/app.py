"""The FastAPI application: its routers and error handlers, and ``assemble``: the services its
lifespan builds, handed to the routes as one typed object per job (no ``app.state``)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from admission.admitter import AdmissionConfig, Admitter
from admission.controller import AdmissionController, ControllerConfig, StoreFailurePolicy
from admission.fair_queue import FairQueueConfig
from admission.fairness_sync import RedisFairnessSync
from admission.tokens import TokenCounters, TokenizerCounter
from billing.cost import CostFigure, CostMeter
from billing.cost_metrics import CostCollector
from billing.metrics import BillingCollector
from billing.service import Billing, BillingConfig
from billing.telemetry import TelemetryCollector
from core.messages import WorkerRole
from gateway.admin.billing import admin_router as billing_admin_router
from gateway.admin.billing import tenant_router as usage_router
from gateway.admin.deps import ADMIN_STATE, AdminServices
from gateway.admin.models import router as models_router
from gateway.admin.planner import router as planner_router
from gateway.admin.rollouts import router as rollouts_router
from gateway.admin.tenants import router as admin_router
from gateway.assembly.openapi import install_openapi
from gateway.assembly.stores import StoreConfig, open_lease, open_spend_store, open_stores
from gateway.audited import CONFIG_ACTOR, register_version, set_policy
from gateway.auth import AdminAuth, Authenticator
from gateway.auth_throttle import AuthThrottleConfig
from gateway.catalog import Catalog, Deployer, VersionBuilder
from gateway.client_address import ClientAddress
from gateway.errors import install_error_handlers
from gateway.limits import RequestLimits, RequestLimitsMiddleware
from gateway.local_actuator import LocalActuator, WorkerLauncher
from gateway.metrics import GatewayMetrics
from gateway.operations import GatewayTraffic
from gateway.planning import LEASE_NAME, GatewayPlanner, PlannerConfig, dry_run_actuator
from gateway.serving.content_policy import ContentPolicy, ModerationSetup, build_moderator
from gateway.serving.deadlines import DeadlineConfig
from gateway.serving.flow import ServingServices
from gateway.serving.gate import Gate, GateConfig
from gateway.serving.golden import EngineCompleter
from gateway.serving.idempotent import IdempotencyConfig, IdempotentRuns
from gateway.serving.routes import SERVING_STATE, HotRoutes
from gateway.serving.routes import router as openai_router
from gateway.serving.routing import Router
from gateway.serving.shadow import ShadowRunner
from gateway.serving.upstream import EngineClient, UpstreamConfig
from kv_transfer.connector import ConnectorConfig
from kv_transfer.decider import DeciderConfig
from planner.actuate import Actuator
from planner.controller import LoadSource
from planner.windows_source import WindowsLoadSource
from rollouts.controller import RolloutController
from rollouts.lease import Lease
from rollouts.provider import AgreementSource, CostSource, MetricsProvider, WindowsProvider
from rollouts.provider_prometheus import PrometheusProvider
from rollouts.quality import QualityCheck, compare
from rollouts.webhook import WebhookSender
from telemetry.otlp_metrics import OtlpGenAiMetrics, OtlpMetricsConfig
from telemetry.tracing import Tracing, TracingConfig
from traffic.backlog import Backlog
from traffic.shadow import ShadowLimiter
from traffic.windows import VersionWindows
from versions.records import ModelVersion
from versions.store import VersionStore
from workers.capacity import DecodeCapacity
from workers.deployments import Deployments
from workers.kv_usage import KvUsageWatcher
from workers.pool import WorkerPool
from workers.registry import Worker, WorkerSource
from workers.scrape import scrape_workers

_OPS = "services"  # the lifespan state key of the whole ``Services`` (for /metrics)


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """Who may call, and how requests are admitted."""

    auth_required: bool = True
    """Require tenant keys; ``False`` serves unknown callers as the unlimited anonymous tenant."""
    auth_throttle: AuthThrottleConfig = field(default_factory=AuthThrottleConfig)
    """Failed authentications slowed per client address, and the proxies trusted to name it."""
    metrics_public: bool = False
    """Anyone may read ``/metrics`` (every tenant's usage); else clients on this host and the
    admin key only."""
    admin_key: str | None = None
    """The admin API's credential; ``None`` leaves the admin API closed (401 for everyone)."""
    stores: StoreConfig = field(default_factory=StoreConfig)
    """Where tenants, keys and quota counters live."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """Store-failure policy and concurrency-hold lifetime."""
    max_queue: int = 1024
    """Requests waiting for admission at once; more are shed."""
    max_in_flight_per_worker: int = 32
    """Admitted requests per healthy decode worker."""
    interactive_headroom: float = 0.0
    """Interactive-band requests may be admitted past that capacity by this fraction of it
    (``AdmissionConfig.interactive_headroom``)."""
    max_band_skips: int = 8
    """Admissions in a row better bands may take while a band waits; the next serves it
    (``FairQueueConfig.max_band_skips``; 0: strict bands)."""
    gate: GateConfig = field(default_factory=GateConfig)
    """Queue deadline."""
    tokenizer_dir: Path | None = None
    """Model folder with the ``tokenizer.json`` prompts are counted with (None: 4 chars/token)."""
    key_touch_interval_s: float = 5.0
    """How often keys' last-used times are written to the registry (batched, off the request
    path); tests shorten it to see ``last_used_at`` without waiting."""
    kv_usage_poll_s: float = 1.0
    """How often the decode workers' KV-cache usage is read from their ``/metrics``."""
    key_cache_ttl_s: float = 0.5
    """How long a key lookup is reused: revocations and plan changes take effect within it."""
    fairness_sync_interval_s: float = 0.1
    """How often this replica's fairness counters are shared through Redis (with a Redis URL):
    a tenant's service on one replica counts on the others within about this long."""


@dataclass(frozen=True, slots=True)
class VersionsConfig:
    """What ``tandem up``'s configuration declares: recorded (and audited) at start."""

    register: tuple[ModelVersion, ...] = ()
    """The versions it deploys (registering one twice is a no-op)."""
    policies: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Alias -> traffic policy (``traffic.policy`` JSON shape); set when it differs from the
    stored one, so a restart keeps what the admin API set unless the file changed it."""
    refresh_interval_s: float = 0.5
    """How often each replica checks the store for a changed policy."""


@dataclass(frozen=True, slots=True)
class RolloutsConfig:
    """The rollout controller every gateway runs (the lease holder acts)."""

    enabled: bool = True
    tick_s: float = 0.25
    """How often the lease holder walks the active rollouts: a failed gate's rollback is put
    in force within about this, plus the policy refresh on the other replicas."""
    lease_ttl_s: float = 5.0
    """A holder that stopped renewing keeps the lease this long: a surviving gateway takes
    over within it and a third more."""
    reports_dir: Path | None = None
    """Where finished rollouts' reports go (``<state_dir>/rollouts``); None: none written."""
    window_bucket_s: float = 10.0
    """The per-version windows' bucket: a gate's window starts up to this before its step."""
    prometheus_url: str | None = None
    """A Prometheus scraping every replica's ``/metrics``: the gates then judge all replicas'
    traffic (``PrometheusProvider``; shadow copies still from this gateway's windows); None:
    this gateway's own windows (``WindowsProvider``)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What the HTTP app itself needs."""

    upstream: UpstreamConfig
    """Time limits towards the workers."""
    sse_ping_interval_s: float = 15.0
    """Heartbeat interval on client streams."""
    decider: DeciderConfig = field(default_factory=DeciderConfig)
    """When a request is split across prefill and decode workers."""
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    """The KV connector the workers run with (the gateway honours its KV lease)."""
    access: AccessConfig = field(default_factory=AccessConfig)
    """Tenants, quotas and admission."""
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    """Default and longest request deadlines."""
    moderation: ModerationSetup = field(default_factory=ModerationSetup)
    """Moderation providers and the default policy."""
    idempotency: IdempotencyConfig = field(default_factory=IdempotencyConfig)
    """Retention of idempotent answers."""
    billing: BillingConfig | None = None
    """The usage ledger, budgets and exports; None switches billing off."""
    versions: VersionsConfig = field(default_factory=VersionsConfig)
    """The versions and traffic policies to record at start."""
    rollouts: RolloutsConfig = field(default_factory=RolloutsConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The autoscaling planner (off by default)."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """Where request traces are exported (``OTEL_*``); off by default."""
    otlp_metrics: OtlpMetricsConfig = field(default_factory=OtlpMetricsConfig)
    """Where the GenAI metrics are pushed over OTLP besides ``/metrics``; off by default."""
    limits: RequestLimits = field(default_factory=RequestLimits)
    """What one request may send (body size and time; the HTTP server bounds the head)."""


@dataclass(frozen=True, slots=True)
class Services:
    """Everything the app's routes use, built once in its lifespan (``assemble``)."""

    serving: ServingServices
    admin: AdminServices
    engine: EngineClient
    """The workers' HTTP client (``/metrics`` re-exports their counters through it)."""


def create_app(
    config: GatewayConfig,
    deployments: Deployments,
    builder: VersionBuilder | None = None,
    deployer: Deployer | None = None,
    launcher: WorkerLauncher | None = None,
) -> FastAPI:
    """Build the gateway app over deployments someone else starts and stops (the CLI or a
    test); ``builder`` registers model sources and ``deployer`` starts and stops more
    versions at runtime (the admin API's); ``launcher`` adds and drains single workers (the
    planner's ``local`` mode)."""
    prefill = deployments.pool(WorkerRole.PREFILL)
    decode = deployments.pool(WorkerRole.DECODE)
    metrics = GatewayMetrics([prefill, decode])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.AsyncExitStack() as resources:
            services = await assemble(
                config, deployments, builder, deployer, metrics, resources, launcher
            )
            # Lifespan state: each request's ``request.state`` gets these; the routers'
            # dependencies read their own part (gateway/serving/routes.py, gateway/admin/deps.py).
            yield {SERVING_STATE: services.serving, ADMIN_STATE: services.admin, _OPS: services}

    app = FastAPI(title="Tandem", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    install_openapi(app, deployments.aliases)
    # Innermost: the hot routes skip the framework's layers below the app's middleware.
    app.add_middleware(HotRoutes, router=app.router)
    app.add_middleware(ClientAddress, trusted_proxies=config.access.auth_throttle.trusted_proxies)
    app.include_router(openai_router)
    app.include_router(admin_router)
    app.include_router(billing_admin_router)
    app.include_router(models_router)
    app.include_router(rollouts_router)
    app.include_router(planner_router)
    app.include_router(usage_router)
    # Outermost: a body is complete, within its limits, before any other layer or route runs.
    app.add_middleware(RequestLimitsMiddleware, limits=config.limits)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics(http_request: Request) -> Response:
        """Prometheus text: requests by path and outcome, latencies, tokens, worker state, and
        the workers' own prefix-cache and KV-transfer counters; OpenMetrics (with exemplars)
        when the scrape's ``Accept`` asks for it."""
        services: Services = getattr(http_request.state, _OPS)
        await services.admin.admin_auth.check_metrics(http_request.headers.get("authorization"))
        from_workers = await scrape_workers(services.engine.session, [prefill, decode])
        body, content_type = metrics.expose(http_request.headers.get("accept"), from_workers)
        return Response(body, media_type=content_type)

    @app.get("/ready")
    async def ready(http_request: Request) -> JSONResponse:
        """Readiness: every deployed version could serve a request now (a healthy decode
        worker, and a healthy prefill worker where it has a prefill pool), or has its decode
        pool scaled to zero by the planner, which starts a worker for the first request."""
        planner = getattr(http_request.state, _OPS).admin.planner
        serving = {
            d.version: d.healthy or (planner is not None and planner.can_wake(d.version))
            for d in deployments
        }
        is_ready = len(deployments) > 0 and all(serving.values())
        body = {
            "status": "ready" if is_ready else "not_ready",
            "versions": serving,
            "workers": [_worker_status(worker) for worker in deployments.workers()],
        }
        return JSONResponse(body, status_code=200 if is_ready else 503)

    return app


async def assemble(
    config: GatewayConfig,
    deployments: Deployments,
    builder: VersionBuilder | None,
    deployer: Deployer | None,
    metrics: GatewayMetrics,
    resources: contextlib.AsyncExitStack,
    launcher: WorkerLauncher | None = None,
) -> Services:
    """Start what the gateway runs (clients, stores, watchers, the admission queue, billing,
    moderation, the traffic policies); each one's shutdown is pushed on ``resources``, so
    they stop in reverse."""
    access = config.access
    decode = deployments.pool(WorkerRole.DECODE)
    tracing = Tracing(config.tracing)
    # First on the stack, so they stop last: what runs stopped at shutdown recorded still goes.
    resources.push_async_callback(tracing.aclose)
    if config.otlp_metrics.enabled:
        otlp_metrics = OtlpGenAiMetrics(config.otlp_metrics)
        resources.push_async_callback(otlp_metrics.aclose)
        metrics.export_over_otlp(otlp_metrics)
    engine = EngineClient(config.upstream)
    await engine.start()
    resources.push_async_callback(engine.aclose)
    stores = await open_stores(access.stores)
    resources.push_async_callback(stores.aclose)
    kv_usage = KvUsageWatcher(engine.session, decode, access.kv_usage_poll_s)
    await kv_usage.start()
    resources.push_async_callback(kv_usage.aclose)
    admitter = await _admitter(access, decode, resources)
    authenticator = Authenticator(
        stores.registry,
        required=access.auth_required,
        cache_ttl_s=access.key_cache_ttl_s,
        touch_interval_s=access.key_touch_interval_s,
        throttle=access.auth_throttle,
    )
    await authenticator.start()
    resources.push_async_callback(authenticator.aclose)
    controller = AdmissionController(
        stores.quotas, admitter, access.controller, metrics.observe_store_error
    )
    catalog = Catalog(deployments, stores.versions, config.versions.refresh_interval_s)
    await record_declared(stores.versions, config.versions)
    await catalog.start()
    resources.push_async_callback(catalog.aclose)
    billing = await _billing(config.billing, access, deployments, metrics, resources)
    counters = TokenCounters(
        await asyncio.to_thread(TokenizerCounter.for_model, access.tokenizer_dir),
        access.tokenizer_dir,  # the first version's folder: its counter is this one
    )
    for deployment in deployments:  # each version's tokenizer before its first request
        await counters.load(deployment.model.tokenizer_dir)
    moderator = await asyncio.to_thread(build_moderator, config.moderation)
    await moderator.start()
    resources.push_async_callback(moderator.aclose)
    idempotency = IdempotentRuns(stores.idempotency, config.idempotency)
    # Closed before the stores, billing and the engine client: runs still going need them.
    resources.push_async_callback(idempotency.aclose)
    gate = Gate(
        access.gate,
        authenticator,
        controller,
        counters,
        metrics,
        check_budget=billing.check_budget if billing is not None else None,
    )
    metrics.watch_admission(admitter)
    windows = VersionWindows(bucket_s=config.rollouts.window_bucket_s)
    shadows = ShadowRunner(engine, windows, ShadowLimiter())
    # Closed before the engine client (pushed later): copies still running use it.
    resources.push_async_callback(shadows.aclose)
    if config.rollouts.enabled:
        provider: MetricsProvider = WindowsProvider(
            windows, _cost_source(billing), _agreement_source(shadows)
        )
        if config.rollouts.prometheus_url is not None:
            prometheus = PrometheusProvider(config.rollouts.prometheus_url, shadow=provider)
            # Closed after the controller (pushed later), which queries it until it stops.
            resources.push_async_callback(prometheus.aclose)
            provider = prometheus
        rollout_controller = RolloutController(
            stores.rollouts,
            stores.lease,
            provider,
            GatewayTraffic(stores.versions, catalog, deployer),
            EngineCompleter(engine, catalog),
            webhooks=await _webhooks(resources),
            reports_dir=config.rollouts.reports_dir,
            tick_s=config.rollouts.tick_s,
            lease_ttl_s=config.rollouts.lease_ttl_s,
        )
        await rollout_controller.start()
        # Stopped before the shadows, catalog and stores it uses (pushed earlier).
        resources.push_async_callback(rollout_controller.aclose)
    backlog = Backlog()
    planner = await _planner(
        config.planner,
        deployments,
        WindowsLoadSource(windows, backlog),
        metrics,
        stores.versions,
        access.stores,
        resources,
        launcher,
        billing,
    )
    serving = ServingServices(
        catalog=catalog,
        router=Router(
            engine,
            deployments,
            config.decider,
            config.connector.kv_lease_s,
            on_no_decode=planner.wake if planner is not None else lambda version: False,
        ),
        gate=gate,
        content=ContentPolicy(moderator, config.moderation.default_policy, metrics),
        idempotency=idempotency,
        metrics=metrics,
        deadlines=config.deadlines,
        ping_interval_s=config.sse_ping_interval_s,
        windows=windows,
        shadows=shadows,
        tracing=tracing,
        billing=billing,
        backlog=backlog,
    )
    admin = AdminServices(
        admin_auth=AdminAuth(access.admin_key, authenticator, metrics_public=access.metrics_public),
        registry=stores.registry,
        controller=controller,
        moderator=moderator,
        authenticate=gate.authenticate,
        forget_keys=authenticator.forget,
        catalog=catalog,
        windows=windows,
        shadow_comparisons=shadows.comparison_dicts,
        shadow_limiter=shadows.limiter,
        builder=builder,
        deployer=deployer,
        token_counters=counters,
        billing=billing,
        rollouts=stores.rollouts,
        rollout_reports=config.rollouts.reports_dir,
        planner=planner,
    )
    return Services(serving=serving, admin=admin, engine=engine)


async def record_declared(store: VersionStore, declared: VersionsConfig) -> None:
    """Record the versions ``tandem up`` deploys and the policies its configuration sets
    (audited as ``config``; unchanged ones are not recorded again)."""
    for version in declared.register:
        await register_version(
            store, version, actor=CONFIG_ACTOR, reason="deployed by tandem up at start"
        )
    for alias, policy in declared.policies:
        await set_policy(
            store, alias, policy, actor=CONFIG_ACTOR, reason="tandem up configuration file"
        )


def _cost_source(billing: Billing | None) -> CostSource | None:
    """A version's measured cost over a window, from the billing cost meter."""
    meter = None if billing is None else billing.cost_meter
    if meter is None:
        return None

    def cost(version: str, window_s: float) -> CostFigure | None:
        window_s = min(window_s, meter.windows_s[-1])
        figures = [f for f in meter.snapshot(windows_s=[window_s]) if f.model_version == version]
        # One deployment per version: the one that served tokens, else the first.
        return max(figures, key=lambda f: f.num_tokens, default=None)

    return cost


def _agreement_source(shadows: ShadowRunner) -> AgreementSource:
    """A shadow version's answers compared with its primaries' over a window, agreeing as the
    quality check's prompts agree (``rollouts.quality.compare``)."""
    check = QualityCheck()

    def agreement(version: str, window_s: float) -> tuple[int, int]:
        since = time.time() - window_s
        compared = agreed = 0
        for comparison in shadows.comparisons(version):
            if comparison.at < since or comparison.primary_text is None:
                continue
            compared += 1
            if (
                comparison.shadow_text is not None
                and compare(
                    comparison.request_id, comparison.primary_text, comparison.shadow_text, check
                ).agrees
            ):
                agreed += 1
        return compared, agreed

    return agreement


async def _planner(
    config: PlannerConfig,
    deployments: Deployments,
    source: LoadSource,
    metrics: GatewayMetrics,
    audit_store: VersionStore,
    stores: StoreConfig,
    resources: contextlib.AsyncExitStack,
    launcher: WorkerLauncher | None,
    billing: Billing | None,
) -> GatewayPlanner | None:
    """The autoscaling planner the configuration asks for, started; None when it is off."""
    if config.mode == "off":
        return None
    lease: Lease | None = None
    actuator: Actuator
    decode_coming = None
    if config.mode == "local":
        if launcher is None:
            raise ValueError("the planner's local mode needs the gateway's own workers")
        local = LocalActuator(
            launcher,
            deployments,
            config.budget,
            config.drain_timeout_s,
            on_drained=lambda version, pool, drained: metrics.observe_planner_drain(
                version, pool, clean=not (drained.cut or drained.kv_unread)
            ),
            on_added=functools.partial(_price_added_worker, billing, deployments),
        )
        # Stopped after the planner (pushed later), before the supervisor stops the pools.
        resources.push_async_callback(local.aclose)
        actuator = local
        decode_coming = local.decode_coming
    elif config.mode == "kubernetes":
        # Imported here: the Kubernetes client takes a noticeable while to import, and every
        # `tandem` command imports this module.
        from planner.kubernetes import KubernetesActuator, KubernetesConfig

        # No credentials: ActuatorError, saying where they were looked for (startup fails).
        kubernetes = KubernetesActuator.from_environment(KubernetesConfig(config.namespace))
        resources.push_async_callback(kubernetes.aclose)
        actuator = kubernetes
        lease = await open_lease(stores, LEASE_NAME)
        resources.push_async_callback(lease.aclose)
    else:
        actuator = dry_run_actuator(deployments)
    planner = GatewayPlanner(
        config,
        deployments,
        source,
        actuator,
        metrics,
        audit_store=audit_store,
        lease=lease,
        decode_coming=decode_coming,
    )
    await planner.start()
    # Stopped before its actuator, its lease and the version store it audits to (pushed
    # earlier), and before the stores close.
    resources.push_async_callback(planner.aclose)
    return planner


async def _webhooks(resources: contextlib.AsyncExitStack) -> WebhookSender:
    sender = WebhookSender()
    resources.push_async_callback(sender.aclose)
    return sender


async def _admitter(
    access: AccessConfig, decode: WorkerSource, resources: contextlib.AsyncExitStack
) -> Admitter:
    """The fair queue, released by decode capacity; with Redis, its fairness shared."""
    admitter = Admitter(
        AdmissionConfig(
            max_queue=access.max_queue,
            max_in_flight=access.max_in_flight_per_worker,
            default_queue_timeout_s=access.gate.queue_timeout_s,
            interactive_headroom=access.interactive_headroom,
        ),
        DecodeCapacity(decode, access.max_in_flight_per_worker),
        FairQueueConfig(max_band_skips=access.max_band_skips),
    )
    await admitter.start()
    resources.push_async_callback(admitter.aclose)
    if access.stores.redis_url:
        # Replicas share fairness too: a tenant's service on any of them counts here.
        fairness = RedisFairnessSync(
            admitter.fair_queue,
            access.stores.redis_url,
            interval_s=access.fairness_sync_interval_s,
            timeout_s=access.stores.timeout_s,
        )
        await fairness.start()
        resources.push_async_callback(fairness.aclose)
    return admitter


async def _billing(
    config: BillingConfig | None,
    access: AccessConfig,
    deployments: Deployments,
    metrics: GatewayMetrics,
    resources: contextlib.AsyncExitStack,
) -> Billing | None:
    """The ledger, its telemetry and their collectors; None when billing is off."""
    if config is None:
        return None
    meter = _cost_meter(config, deployments)
    # Budgets follow the quota store's failure policy when the spend counter is down.
    closed = access.controller.store_failure is StoreFailurePolicy.CLOSED
    config = dataclasses.replace(config, spend_store_failure="closed" if closed else "open")
    billing = Billing(config, cost_meter=meter, spend_store=open_spend_store(access.stores))
    await billing.start()
    # Closed after the idempotent runs (pushed later): runs still going record.
    resources.push_async_callback(billing.aclose)
    telemetry = TelemetryCollector(
        meter, functools.partial(_worker_pids, deployments), interval_s=config.telemetry_interval_s
    )
    await telemetry.start()
    resources.push_async_callback(telemetry.aclose)
    for collector in (BillingCollector(billing), CostCollector(meter, telemetry)):
        metrics.registry.register(collector)
        resources.callback(metrics.registry.unregister, collector)
    return billing


def _cost_meter(config: BillingConfig, deployments: Deployments) -> CostMeter:
    """Every worker priced as configured, under the version it serves."""
    return CostMeter(
        [
            config.worker_cost(worker.name, deployment.model.deployment, deployment.version)
            for deployment in deployments
            for worker in deployment.workers
        ]
    )


def _price_added_worker(
    billing: Billing | None,
    deployments: Deployments,
    version: str,
    worker: Worker,
    sibling: str | None,
) -> None:
    """A worker the planner added costs what its pool's others do, or else the configured
    price (provisioned from its first telemetry sample until it stops)."""
    deployment = deployments.get(version)
    if billing is None or deployment is None:
        return
    if sibling is None or not billing.price_like(worker.name, sibling):
        billing.price_worker(worker.name, deployment.model.deployment, version)


def _worker_pids(deployments: Deployments) -> dict[str, int | None]:
    """Worker name -> pid of its process (None for workers someone else started)."""
    pids: dict[str, int | None] = {}
    for deployment in deployments:
        for pool in (deployment.prefill, deployment.decode):
            statuses = pool.status() if isinstance(pool, WorkerPool) else []
            known = {status.name: status.pid for status in statuses}
            for worker in pool.workers:
                pids[worker.name] = known.get(worker.name)
    return pids


def _worker_status(worker: Worker) -> dict[str, Any]:
    return {
        "name": worker.name,
        "role": str(worker.role),
        "url": worker.base_url,
        "healthy": worker.healthy,
        "draining": worker.draining,
        "outstanding": worker.num_outstanding,
    }
