"""The FastAPI application: routes, error handlers, and the resources built in its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.pipeline import ServedModel, ServingPipeline
from gateway.routes_openai import router as openai_router
from gateway.upstream import EngineClient, UpstreamConfig
from gateway.worker_metrics import scrape_workers
from kv_transfer.decider import DeciderConfig
from workers.registry import Worker, WorkerSource


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """What the HTTP app itself needs."""

    upstream: UpstreamConfig
    """Time limits towards the workers."""
    sse_ping_interval_s: float = 15.0
    """Heartbeat interval on client streams."""
    decider: DeciderConfig = field(default_factory=DeciderConfig)
    """When a request is split across prefill and decode workers."""


def create_app(
    config: GatewayConfig,
    prefill: WorkerSource,
    decode: WorkerSource,
    models: Sequence[ServedModel],
) -> FastAPI:
    """Build the gateway app over pools someone else starts and stops (the CLI or a test)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = EngineClient(config.upstream)
        await engine.start()
        app.state.pipeline = ServingPipeline(
            engine, prefill, decode, models, config.decider, metrics
        )
        app.state.sse_ping_interval_s = config.sse_ping_interval_s
        app.state.engine = engine
        try:
            yield
        finally:
            await engine.aclose()

    metrics = GatewayMetrics([prefill, decode])
    app = FastAPI(title="Tandem", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(openai_router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness: the gateway process answers."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics(http_request: Request) -> Response:
        """Prometheus text: requests by path and outcome, latencies, tokens, worker state, and
        the workers' own prefix-cache and KV-transfer counters."""
        engine: EngineClient = http_request.app.state.engine
        from_workers = await scrape_workers(engine.session, [prefill, decode])
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


def _worker_status(worker: Worker) -> dict[str, Any]:
    return {
        "name": worker.name,
        "role": str(worker.role),
        "url": worker.base_url,
        "healthy": worker.healthy,
        "outstanding": worker.num_outstanding,
    }
