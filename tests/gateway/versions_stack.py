"""A gateway serving several versions of one alias, each on fake engines of its own.

The first version is deployed at start as ``tandem up`` deploys it (planned by the same
``Supervisor``, registered through ``VersionsConfig``); later ones go through the admin API like
an operator's: ``POST /admin/v1/models`` fingerprints a fake model folder (other weights bytes or
defaults give another version) and ``POST /admin/v1/deployments`` reaches its fake decode engine
(``decode_urls``, ``served_as`` = the fake's model name, so the fake refuses a request that
names any other model). Real uvicorn, the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from billing.service import BillingConfig
from gateway.assembly.app import AccessConfig, GatewayConfig, VersionsConfig, create_app
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stores import StoreConfig
from gateway.assembly.supervisor import LocalVersionBuilder, Supervisor
from gateway.catalog import DeploymentSpec
from gateway.serving.upstream import UpstreamConfig
from kv_transfer.decider import DeciderConfig
from tests.fakes.fake_engine import FakeEngine
from tests.fakes.model_folder import fake_model_folder, fake_version
from tests.gateway.conftest import ADMIN_KEY, stop_server, wait_until
from tests.server_process import free_port
from workers.deployments import Deployments

ALIAS = "smol"


@dataclass
class Version:
    """A deployed version and the fake engines serving it."""

    name: str
    """``smol@<id8>``: what responses and the ledger name."""
    decode: FakeEngine
    prefill: FakeEngine | None = None


@dataclass
class VersionsStack:
    base_url: str
    admin: httpx.AsyncClient
    """``/admin/v1`` with the admin key."""
    api_key: str
    """A key of the ``default`` tenant (unlimited plan)."""
    client: openai.AsyncOpenAI
    state_dir: Path
    versions: list[Version] = field(default_factory=list)
    engines: list[FakeEngine] = field(default_factory=list)

    def client_for(self, api_key: str) -> openai.AsyncOpenAI:
        """An OpenAI client with another key (the caller closes it)."""
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)

    async def new_tenant(self, name: str, **plan: object) -> str:
        """A tenant with ``plan``; a fresh key of it."""
        return (await self.new_tenant_key(name, **plan))["key"]

    async def new_tenant_key(self, name: str, **plan: object) -> dict[str, str]:
        """A tenant with ``plan``; the issued key's JSON (``key``, ``key_id``, ``tenant_id``)."""
        created = await self.admin.post("/admin/v1/tenants", json={"name": name, **plan})
        assert created.status_code == 201, created.text
        return await self.issue_key(name)

    async def issue_key(self, tenant: str) -> dict[str, str]:
        issued = await self.admin.post(f"/admin/v1/tenants/{tenant}/keys", json={})
        assert issued.status_code == 201, issued.text
        return dict(issued.json())

    def folder(self, weights: bytes) -> Path:
        """A fake model folder with ``weights`` (one per weights)."""
        return fake_model_folder(self.state_dir / "models" / weights.hex()[:32], weights)

    async def register(
        self,
        weights: bytes,
        defaults: dict[str, Any] | None = None,
        reason: str = "",
        alias: str = ALIAS,
    ) -> httpx.Response:
        """``POST /admin/v1/models`` for a fake folder holding ``weights``."""
        body = {
            "source": str(self.folder(weights)),
            "alias": alias,
            "defaults": defaults or {},
            "reason": reason,
        }
        return await self.admin.post("/admin/v1/models", json=body)

    async def start_engine(
        self, name: str, engine_class: type[FakeEngine] = FakeEngine, **knobs: Any
    ) -> FakeEngine:
        """A fake decode engine serving ``name`` (stopped with the stack)."""
        engine = await engine_class(name, role="decode", max_model_len=2048).start()
        for knob, value in knobs.items():
            setattr(engine, knob, value)
        self.engines.append(engine)
        return engine

    async def add_version(
        self,
        weights: bytes,
        defaults: dict[str, Any] | None = None,
        engine_class: type[FakeEngine] = FakeEngine,
        **knobs: Any,
    ) -> Version:
        """Register a version, start its decode engine (``knobs``: its fault attributes) and
        deploy it through the admin API."""
        registered = await self.register(weights, defaults, reason="a candidate")
        assert registered.status_code == 201, registered.text
        name = str(registered.json()["name"])
        engine = await self.start_engine(f"engine-{len(self.versions)}", engine_class, **knobs)
        deployed = await self.deploy(name, engine)
        assert deployed.status_code == 201, deployed.text
        version = Version(name, engine)
        self.versions.append(version)
        return version

    async def deploy(self, name: str, engine: FakeEngine) -> httpx.Response:
        body = {
            "version": name,
            "decode_workers": 0,
            "decode_urls": [engine.base_url],
            "served_as": engine.served_model_name,
            "reason": "fake engine",
        }
        return await self.admin.post("/admin/v1/deployments", json=body)

    async def put_policy(self, policy: dict[str, Any], alias: str = ALIAS) -> httpx.Response:
        return await self.admin.put(f"/admin/v1/traffic/{alias}", json=policy)

    async def set_split(self, *weights: tuple[Version, float], **policy: Any) -> None:
        """Put a policy splitting ``alias`` over ``weights`` (plus the other ``policy`` fields)."""
        split = [{"version": v.name, "weight": w} for v, w in weights]
        response = await self.put_policy({"split": split, **policy})
        assert response.status_code == 200, response.text


@asynccontextmanager
async def make_versions_stack(
    *,
    first_with_prefill: bool = False,
    access: AccessConfig | None = None,
    **gateway: Any,
) -> AsyncIterator[VersionsStack]:
    """The gateway with version ``versions[0]`` (weights ``b"v0"``) deployed at start on a
    fake decode engine (and a fake prefill engine with ``first_with_prefill``); add more with
    ``add_version``. ``gateway`` replaces ``GatewayConfig`` fields."""
    state_dir = Path(tempfile.mkdtemp(prefix="tandem-versions-"))
    settings = TandemSettings(
        state_dir=state_dir,
        cache_dir=state_dir / "cache",
        health_interval_s=0.05,
        worker_ready_timeout_s=5,
    )
    first = fake_version(state_dir / "models" / "v0", ALIAS, weights=b"v0")
    engines: list[FakeEngine] = []
    decode = await FakeEngine("engine-first", role="decode", max_model_len=2048).start()
    engines.append(decode)
    prefill = None
    if first_with_prefill:
        prefill = await FakeEngine("engine-first", role="prefill", max_model_len=2048).start()
        engines.append(prefill)
    supervisor = Supervisor(settings)
    spec = DeploymentSpec(
        num_prefill=0,
        num_decode=0,
        prefill_urls=(prefill.base_url,) if prefill is not None else (),
        decode_urls=(decode.base_url,),
        served_as=decode.served_model_name,
    )
    deployment = supervisor.plan(first, spec)
    await supervisor.start(deployment)
    await asyncio.gather(*(pool.wait_ready(5) for pool in supervisor.pools()))
    config = GatewayConfig(
        upstream=UpstreamConfig(connect_timeout_s=1, prefill_timeout_s=5, decode_idle_timeout_s=5),
        sse_ping_interval_s=0.2,
        decider=DeciderConfig(min_prompt_tokens=0),
        access=access
        or AccessConfig(
            admin_key=ADMIN_KEY, stores=StoreConfig(sqlite_path=state_dir / "tandem.db")
        ),
        billing=BillingConfig(
            sqlite_path=state_dir / "ledger.db",
            spool_dir=state_dir / "ledger-spool",
            refresh_interval_s=0.2,
            flush_interval_s=0.05,
        ),
        versions=VersionsConfig(register=(first,), refresh_interval_s=0.1),
    )
    config = dataclasses.replace(config, **gateway)
    app = create_app(config, Deployments([deployment]), LocalVersionBuilder(settings), supervisor)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    base_url = f"http://127.0.0.1:{port}"
    admin = httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )
    stack = VersionsStack(
        base_url, admin, "", openai.AsyncOpenAI(base_url="http://unused", api_key="x"), state_dir
    )
    stack.engines.extend(engines)
    stack.versions.append(Version(first.name, decode, prefill))
    try:
        stack.api_key = await stack.new_tenant("default")
        await stack.client.close()
        stack.client = stack.client_for(stack.api_key)
        yield stack
    finally:
        await stack.client.close()
        await admin.aclose()
        await stop_server(server, serving)
        await supervisor.aclose()
        for engine in stack.engines:
            await engine.aclose()
        shutil.rmtree(state_dir, ignore_errors=True)
