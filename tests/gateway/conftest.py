"""The gateway on a real uvicorn server over fake engines that speak vLLM's HTTP protocol.

Fast tier only: the same behaviours are checked against real vLLM workers in ``tests/e2e``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from starlette.types import ASGIApp

from billing.service import BillingConfig
from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.app import AccessConfig, GatewayConfig, create_app
from gateway.assembly.stores import StoreConfig
from gateway.cli.http_protocol import LimitedHttpToolsProtocol, limited_httptools
from gateway.cli.main import main
from gateway.limits import RequestLimits
from gateway.serving.upstream import UpstreamConfig
from kv_transfer.decider import DeciderConfig
from tests.fakes.fake_engine import FakeEngine
from tests.server_process import free_port
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

MODEL = "fake-model"
ADMIN_KEY = "test-admin-key"


@dataclass
class FakeStack:
    base_url: str
    prefill: FakeEngine
    decode: FakeEngine
    prefill_pool: WorkerPool
    decode_pool: WorkerPool
    client: openai.AsyncOpenAI
    decodes: list[FakeEngine]
    prefills: list[FakeEngine]
    api_key: str
    """A key of the ``default`` tenant (unlimited plan) that ``client`` uses."""
    admin: httpx.AsyncClient
    """Talks to ``/admin/v1`` with the admin key."""

    @property
    def auth_headers(self) -> dict[str, str]:
        """``Authorization`` for raw HTTP calls as the default tenant."""
        return {"Authorization": f"Bearer {self.api_key}"}

    async def new_tenant(self, name: str, **plan: object) -> str:
        """Create a tenant with ``plan`` through the admin API; return a fresh key of it."""
        created = await self.admin.post("/admin/v1/tenants", json={"name": name, **plan})
        assert created.status_code == 201, created.text
        issued = await self.admin.post(f"/admin/v1/tenants/{name}/keys", json={})
        assert issued.status_code == 201, issued.text
        return str(issued.json()["key"])

    def client_for(self, api_key: str) -> openai.AsyncOpenAI:
        """An OpenAI client with another key (the caller closes it)."""
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0)


async def wait_until(condition: object, timeout_s: float = 5.0) -> None:
    """Poll ``condition()`` until it is true or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def gateway_protocol_serving(app: ASGIApp, **options: Any) -> AsyncIterator[int]:
    """``app`` on a real uvicorn server with the gateway's own HTTP protocol; yields its port."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
        http=limited_httptools(RequestLimits()), **options,
    )  # fmt: skip
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        await wait_until(lambda: server.started)
        yield port
    finally:
        server.should_exit = True
        await serving


def live_protocols(port: int | None = None) -> list[LimitedHttpToolsProtocol]:
    """The gateway protocols still alive; with ``port``, only that server's connections
    (another test's server may still hold some)."""
    gc.collect()
    return [
        item
        for item in gc.get_objects()
        if isinstance(item, LimitedHttpToolsProtocol)
        and (port is None or (item.server is not None and item.server[1] == port))
    ]


@asynccontextmanager
async def make_fake_stack(
    num_decode: int = 1,
    num_prefill: int = 1,
    access: AccessConfig | None = None,
    gateway: dict[str, Any] | None = None,
    model: ServedModel | None = None,
    pool_options: dict[str, Any] | None = None,
    http: str | type[asyncio.Protocol] | None = None,
    **upstream: float,
) -> AsyncIterator[FakeStack]:
    """Fake prefill and decode engines behind pools, and the gateway on a real uvicorn server.

    ``prefill``/``decode`` are the first engines of each role; all are in ``prefills``/``decodes``.
    Tenants live in a throwaway SQLite file unless ``access`` says otherwise; the admin key is
    ``ADMIN_KEY``. ``gateway`` replaces other ``GatewayConfig`` fields; ``model`` replaces the
    served model (``MODEL``, 256 tokens of context); ``pool_options`` replaces ``PoolConfig`` fields
    of both pools (e.g. ``kv_watermark``). ``http`` is uvicorn's HTTP protocol: by default the
    gateway's own, as ``tandem up`` serves (``gateway/cli/http_protocol.py``).
    """
    state_dir = Path(tempfile.mkdtemp(prefix="tandem-test-"))
    prefills = [
        await FakeEngine(MODEL, role="prefill", max_model_len=256).start()
        for _ in range(num_prefill)
    ]
    decodes = [
        await FakeEngine(MODEL, role="decode", max_model_len=256).start() for _ in range(num_decode)
    ]
    pools = [
        WorkerPool(
            PoolConfig(
                WorkerRole.PREFILL,
                external_urls=tuple(engine.base_url for engine in prefills),
                health_interval_s=0.05,
                **(pool_options or {}),
            )
        ),
        WorkerPool(
            PoolConfig(
                WorkerRole.DECODE,
                external_urls=tuple(engine.base_url for engine in decodes),
                health_interval_s=0.05,
                **(pool_options or {}),
            )
        ),
    ]
    for pool in pools:
        await pool.start()
        await pool.wait_ready(timeout_s=5)
    limits = {
        "connect_timeout_s": 1,
        "prefill_timeout_s": 5,
        "decode_idle_timeout_s": 2,
        **upstream,
    }
    config = GatewayConfig(
        upstream=UpstreamConfig(**limits),
        sse_ping_interval_s=0.2,
        decider=DeciderConfig(
            min_prompt_tokens=0
        ),  # split everything; the decider has its own tests
        access=access
        or AccessConfig(
            admin_key=ADMIN_KEY, stores=StoreConfig(sqlite_path=state_dir / "tandem.db")
        ),
        # Billing is on in every gateway test: each request there also goes through the ledger.
        billing=BillingConfig(
            sqlite_path=state_dir / "ledger.db",
            spool_dir=state_dir / "ledger-spool",
            refresh_interval_s=0.2,
            flush_interval_s=0.05,
        ),
    )
    config = dataclasses.replace(config, **(gateway or {}))
    deployment = Deployment(model or ServedModel(MODEL, 256, 0), pools[0], pools[1])
    app = create_app(config, Deployments([deployment]))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            http=http or limited_httptools(RequestLimits()),
        )
    )
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    base_url = f"http://127.0.0.1:{port}"
    admin = httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    # The client needs the key, which needs the running server: set below.
    stack = FakeStack(
        base_url, prefills[0], decodes[0], pools[0], pools[1],
        None,  # type: ignore[arg-type]
        decodes, prefills, "", admin,
    )  # fmt: skip
    try:
        if config.access.admin_key == ADMIN_KEY:
            stack.api_key = await stack.new_tenant("default")
        stack.client = stack.client_for(stack.api_key or "no-key")
        yield stack
    finally:
        if stack.client is not None:
            await stack.client.close()
        await admin.aclose()
        shutil.rmtree(state_dir, ignore_errors=True)
        await stop_server(server, serving)
        for pool in pools:
            await pool.aclose()
        for engine in (*prefills, *decodes):
            await engine.aclose()


async def stop_server(
    server: uvicorn.Server, serving: asyncio.Task[None], timeout_s: float = 30.0
) -> None:
    """Stop a test gateway: a graceful shutdown that does not end within ``timeout_s`` fails
    the test with the stacks of the tasks still running (a request task that never ends is a
    leak), instead of hanging the session until pytest's timeout."""
    server.should_exit = True
    done, _ = await asyncio.wait({serving}, timeout=timeout_s)
    if done:
        serving.result()
        return
    stuck = task_stacks()
    server.force_exit = True  # uvicorn stops waiting for connections and tasks
    await asyncio.wait({serving}, timeout=timeout_s)
    pytest.fail(f"the gateway did not stop within {timeout_s:.0f} s; still running:\n{stuck}")


def task_stacks() -> str:
    """Each pending task and the chain of coroutines it is suspended in, innermost last."""
    lines: list[str] = []
    for task in asyncio.all_tasks():
        if task is asyncio.current_task():
            continue
        lines.append(f"- {task.get_name()}")
        awaiting: Any = task.get_coro()
        while awaiting is not None:
            frame = getattr(awaiting, "cr_frame", None) or getattr(awaiting, "ag_frame", None)
            if frame is not None:
                code = frame.f_code
                lines.append(f"    {code.co_filename}:{frame.f_lineno} {code.co_name}")
            awaiting = getattr(awaiting, "cr_await", None) or getattr(awaiting, "ag_await", None)
    return "\n".join(lines)


@pytest.fixture
async def fake_stack() -> AsyncIterator[FakeStack]:
    async with make_fake_stack() as stack:
        yield stack


async def run_cli(
    capsys: pytest.CaptureFixture[str], stack: FakeStack, command: str, *argv: str
) -> tuple[int, str, str]:
    """``tandem <command> --url <stack> --admin-key ... <argv>``: exit code, stdout, stderr."""
    # The CLI is synchronous; off the loop, so the gateway in this loop can answer it.
    code = await asyncio.to_thread(
        main, [command, "--url", stack.base_url, "--admin-key", ADMIN_KEY, *argv]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err
