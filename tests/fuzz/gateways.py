"""The two gateways the fuzz tests run against, both on fake engines that speak vLLM's protocol:

- ``in_process_gateway``: the app itself, called in-process over ASGI (schemathesis' own ASGI
  transport runs its lifespan in a thread of its own); the fake engines and their pools run on
  an event loop in another thread, as a worker's process would;
- ``running_gateway``: ``tandem up`` as its own process (uvicorn on httptools with the
  gateway's HTTP protocol and settings, as in production) over a fake decode engine process.

Each yields a ``Gateway``: where it is, its admin key, and a tenant's key.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI
from schemathesis.python import asgi

from billing.service import BillingConfig
from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.app import AccessConfig, GatewayConfig, create_app
from gateway.assembly.stores import StoreConfig
from gateway.auth_throttle import AuthThrottleConfig
from gateway.serving.upstream import UpstreamConfig
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.replica import fake_engine_process, gateway_process, wait_ready
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

MODEL = "fake-model"
ADMIN_KEY = "fuzz-admin-key"
CONTEXT_WINDOW = 2048
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Gateway:
    """A gateway under test and the keys to call it with."""

    admin_key: str
    tenant_key: str
    """A key of the ``fuzz`` tenant (unlimited plan)."""
    base_url: str | None = None
    """Where a running gateway listens (None: in-process)."""
    app: FastAPI | None = None
    """The in-process gateway (None: a running one)."""


class _EngineLoop:
    """An event loop in a thread of its own, for what the in-process gateway calls over HTTP."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-engines")
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@contextmanager
def in_process_gateway() -> Iterator[Gateway]:
    """The app over a fake prefill and a fake decode engine, its lifespan started."""
    state_dir = Path(tempfile.mkdtemp(prefix="tandem-fuzz-"))
    engines = _EngineLoop()
    try:
        started = engines.run(_start_engines())
        try:
            app = create_app(_config(state_dir), Deployments([started.deployment]))
            with asgi.get_client(app) as client:
                tenant_key = _new_tenant_key(client)
                yield Gateway(ADMIN_KEY, tenant_key, app=app)
            asgi.shutdown_lifespans()
        finally:
            engines.run(started.aclose())
    finally:
        engines.close()
        shutil.rmtree(state_dir, ignore_errors=True)


@contextmanager
def running_gateway(env: dict[str, str] | None = None) -> Iterator[Gateway]:
    """``tandem up`` over a fake decode engine, each its own process; ``env`` adds settings."""
    work_dir = Path(tempfile.mkdtemp(prefix="tandem-fuzz-"))
    try:
        with fake_engine_process(
            work_dir, name="engine", served_model_name=MODEL, output_tokens=4
        ) as engine:
            settings = {
                "TANDEM_ADMIN_KEY": ADMIN_KEY,
                "TANDEM_STATE_DIR": str(work_dir / "state"),
                "TANDEM_MAX_MODEL_LEN": str(CONTEXT_WINDOW),
                "TANDEM_AUTH_FAILURE_LIMIT": "0",
                **(env or {}),
            }
            with gateway_process(
                work_dir,
                name="gateway",
                decode_urls=[engine.base_url],
                served_model_name=MODEL,
                env=settings,
            ) as gateway:
                wait_ready(gateway)
                with httpx.Client(base_url=gateway.base_url, timeout=10.0) as client:
                    tenant_key = _new_tenant_key(client)
                yield Gateway(ADMIN_KEY, tenant_key, base_url=gateway.base_url)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def _new_tenant_key(client: Any) -> str:
    """Create the ``fuzz`` tenant through the admin API (``client``: httpx or requests) and
    issue it a key."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    created = client.post("/admin/v1/tenants", json={"name": "fuzz"}, headers=admin)
    assert created.status_code == 201, created.text
    issued = client.post("/admin/v1/tenants/fuzz/keys", json={}, headers=admin)
    assert issued.status_code == 201, issued.text
    return str(issued.json()["key"])


@dataclass
class _Engines:
    engines: list[FakeEngine]
    pools: list[WorkerPool]
    deployment: Deployment

    async def aclose(self) -> None:
        for pool in self.pools:
            await pool.aclose()
        for engine in self.engines:
            await engine.aclose()


async def _start_engines() -> _Engines:
    engines = [
        await FakeEngine(MODEL, role=role, max_model_len=CONTEXT_WINDOW, output_tokens=4).start()
        for role in ("prefill", "decode")
    ]
    pools = [
        WorkerPool(PoolConfig(role, external_urls=(engine.base_url,), health_interval_s=0.05))
        for role, engine in zip((WorkerRole.PREFILL, WorkerRole.DECODE), engines, strict=True)
    ]
    for pool in pools:
        await pool.start()
        await pool.wait_ready(timeout_s=5)
    deployment = Deployment(ServedModel(MODEL, CONTEXT_WINDOW, 0), pools[0], pools[1])
    return _Engines(engines, pools, deployment)


def _config(state_dir: Path) -> GatewayConfig:
    return GatewayConfig(
        upstream=UpstreamConfig(connect_timeout_s=1, prefill_timeout_s=5, decode_idle_timeout_s=2),
        sse_ping_interval_s=0.2,
        access=AccessConfig(
            admin_key=ADMIN_KEY,
            stores=StoreConfig(sqlite_path=state_dir / "tandem.db"),
            # The fuzzer sends bad keys on purpose: throttling its address would answer the rest
            # of the run 429 (the throttle has tests of its own).
            auth_throttle=AuthThrottleConfig(max_failures=0),
        ),
        billing=BillingConfig(
            sqlite_path=state_dir / "ledger.db",
            spool_dir=state_dir / "ledger-spool",
            refresh_interval_s=0.2,
            flush_interval_s=0.05,
        ),
    )
