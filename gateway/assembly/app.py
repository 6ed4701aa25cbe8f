"""The FastAPI application: its routers and error handlers, and ``assemble``: the services its
lifespan builds, handed to the routes as one typed object per job (no ``app.state``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from admission.admitter import AdmissionConfig, Admitter
from admission.controller import AdmissionController, ControllerConfig
from admission.fair_queue import FairQueueConfig
from admission.fairness_sync import RedisFairnessSync
from admission.tokens import TokenizerCounter
from billing.cost import CostMeter, WorkerCost
from billing.cost_metrics import CostCollector
from billing.metrics import BillingCollector
from billing.service import Billing, BillingConfig
from billing.telemetry import TelemetryCollector
from core.models import ServedModel
from gateway.admin.billing import admin_router as billing_admin_router
from gateway.admin.billing import tenant_router as usage_router
from gateway.admin.deps import ADMIN_STATE, AdminServices
from gateway.admin.tenants import router as admin_router
from gateway.assembly.stores import StoreConfig, open_stores
from gateway.auth import AdminAuth, Authenticator
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.serving.content_policy import ContentPolicy, ModerationSetup, build_moderator
from gateway.serving.deadlines import DeadlineConfig
from gateway.serving.flow import ServingServices
from gateway.serving.gate import Gate, GateConfig
from gateway.serving.idempotent import IdempotencyConfig, IdempotentRuns
from gateway.serving.routes import SERVING_STATE
from gateway.serving.routes import router as openai_router
from gateway.serving.routing import Router
from gateway.serving.upstream import EngineClient, UpstreamConfig
from kv_transfer.connector import ConnectorConfig
from kv_transfer.decider import DeciderConfig
from workers.capacity import DecodeCapacity
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


@dataclass(frozen=True, slots=True)
class Services:
    """Everything the app's routes use, built once in its lifespan (``assemble``)."""

    serving: ServingServices
    admin: AdminServices
    engine: EngineClient
    """The workers' HTTP client (``/metrics`` re-exports their counters through it)."""


def create_app(
    config: GatewayConfig,
    prefill: WorkerSource,
    decode: WorkerSource,
    models: Sequence[ServedModel],
) -> FastAPI:
    """Build the gateway app over pools someone else starts and stops (the CLI or a test)."""
    metrics = GatewayMetrics([prefill, decode])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with contextlib.AsyncExitStack() as resources:
            services = await assemble(config, prefill, decode, models, metrics, resources)
            # Lifespan state: each request's ``request.state`` gets these; the routers'
            # dependencies read their own part (gateway/serving/routes.py, gateway/admin/deps.py).
            yield {SERVING_STATE: services.serving, ADMIN_STATE: services.admin, _OPS: services}

    app = FastAPI(title="Tandem", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(admin_router)
    app.include_router(billing_admin_router)
    app.include_router(usage_router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics(http_request: Request) -> Response:
        """Prometheus text: requests by path and outcome, latencies, tokens, worker state, and
        the workers' own prefix-cache and KV-transfer counters."""
        services: Services = getattr(http_request.state, _OPS)
        from_workers = await scrape_workers(services.engine.session, [prefill, decode])
        return Response(metrics.render() + from_workers.encode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: a request could be served now (a healthy decode worker, and a healthy
        prefill worker when a prefill pool is configured)."""
        decode_ok = any(worker.healthy for worker in decode.workers)
        prefill_ok = not prefill.workers or any(worker.healthy for worker in prefill.workers)
        is_ready = decode_ok and prefill_ok
        body = {
            "status": "ready" if is_ready else "not_ready",
            "workers": [_worker_status(worker) for worker in (*prefill.workers, *decode.workers)],
        }
        return JSONResponse(body, status_code=200 if is_ready else 503)

    return app


async def assemble(
    config: GatewayConfig,
    prefill: WorkerSource,
    decode: WorkerSource,
    models: Sequence[ServedModel],
    metrics: GatewayMetrics,
    resources: contextlib.AsyncExitStack,
) -> Services:
    """Start what the gateway runs (clients, stores, watchers, the admission queue, billing,
    moderation); each one's shutdown is pushed on ``resources``, so they stop in reverse."""
    access = config.access
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
    )
    await authenticator.start()
    resources.push_async_callback(authenticator.aclose)
    controller = AdmissionController(
        stores.quotas, admitter, access.controller, metrics.observe_store_error
    )
    billing = await _billing(config.billing, models[0], (prefill, decode), metrics, resources)
    counter = await asyncio.to_thread(TokenizerCounter.for_model, access.tokenizer_dir)
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
        counter,
        metrics,
        check_budget=billing.check_budget if billing is not None else None,
    )
    metrics.watch_admission(admitter)
    serving = ServingServices(
        router=Router(engine, prefill, decode, models, config.decider, config.connector.kv_lease_s),
        gate=gate,
        content=ContentPolicy(moderator, config.moderation.default_policy, metrics),
        idempotency=idempotency,
        metrics=metrics,
        deadlines=config.deadlines,
        ping_interval_s=config.sse_ping_interval_s,
        billing=billing,
    )
    admin = AdminServices(
        admin_auth=AdminAuth(access.admin_key, authenticator),
        registry=stores.registry,
        controller=controller,
        moderator=moderator,
        authenticate=gate.authenticate,
        billing=billing,
    )
    return Services(serving=serving, admin=admin, engine=engine)


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
    model: ServedModel,
    pools: Sequence[WorkerSource],
    metrics: GatewayMetrics,
    resources: contextlib.AsyncExitStack,
) -> Billing | None:
    """The ledger, its telemetry and their collectors; None when billing is off."""
    if config is None:
        return None
    meter = _cost_meter(config, model, pools)
    billing = Billing(config, cost_meter=meter)
    await billing.start()
    # Closed after the idempotent runs (pushed later): runs still going record.
    resources.push_async_callback(billing.aclose)
    telemetry = TelemetryCollector(
        meter, functools.partial(_worker_pids, pools), interval_s=config.telemetry_interval_s
    )
    await telemetry.start()
    resources.push_async_callback(telemetry.aclose)
    for collector in (BillingCollector(billing), CostCollector(meter, telemetry)):
        metrics.registry.register(collector)
        resources.callback(metrics.registry.unregister, collector)
    return billing


def _cost_meter(
    config: BillingConfig, model: ServedModel, pools: Sequence[WorkerSource]
) -> CostMeter:
    """Every worker priced as configured; they all serve ``model``."""
    return CostMeter(
        [
            WorkerCost(
                worker.name,
                model.deployment,
                model.version or model.name,
                config.worker_price(worker.name),
            )
            for pool in pools
            for worker in pool.workers
        ]
    )


def _worker_pids(pools: Sequence[WorkerSource]) -> dict[str, int | None]:
    """Worker name -> pid of its process (None for workers someone else started)."""
    pids: dict[str, int | None] = {}
    for pool in pools:
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
        "outstanding": worker.num_outstanding,
    }
