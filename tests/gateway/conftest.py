"""The gateway on a real uvicorn server over fake engines that speak vLLM's HTTP protocol.

Fast tier only: the same behaviours are checked against real vLLM workers in ``tests/e2e``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import openai
import pytest
import uvicorn

from core.messages import WorkerRole
from gateway.app import GatewayConfig, create_app
from gateway.pipeline import ServedModel
from gateway.upstream import UpstreamConfig
from kv_transfer.decider import DeciderConfig
from tests.fakes.fake_engine import FakeEngine
from workers.pool import PoolConfig, WorkerPool

MODEL = "fake-model"


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_until(condition: object, timeout_s: float = 5.0) -> None:
    """Poll ``condition()`` until it is true or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@asynccontextmanager
async def make_fake_stack(
    num_decode: int = 1, num_prefill: int = 1, **upstream: float
) -> AsyncIterator[FakeStack]:
    """Fake prefill and decode engines behind pools, and the gateway on a real uvicorn server.

    ``prefill``/``decode`` are the first engines of each role; all are in ``prefills``/``decodes``.
    """
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
            )
        ),
        WorkerPool(
            PoolConfig(
                WorkerRole.DECODE,
                external_urls=tuple(engine.base_url for engine in decodes),
                health_interval_s=0.05,
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
    )
    app = create_app(config, pools[0], pools[1], [ServedModel(MODEL, 256, 0)])
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    base_url = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    try:
        yield FakeStack(
            base_url, prefills[0], decodes[0], pools[0], pools[1], client, decodes, prefills
        )
    finally:
        await client.close()
        server.should_exit = True
        await serving
        for pool in pools:
            await pool.aclose()
        for engine in (*prefills, *decodes):
            await engine.aclose()


@pytest.fixture
async def fake_stack() -> AsyncIterator[FakeStack]:
    async with make_fake_stack() as stack:
        yield stack
