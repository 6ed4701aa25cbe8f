"""Shared fixtures of the bench tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from bench.overhead.fake_http import serve
from bench.overhead.fake_vllm import FakeVllm, Timing

FAKE_MODEL = "fake-model"


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVllm, str]]:
    """The fake vLLM engine in this process (4-token answers, 2 ms apart), and its URL."""
    engine = FakeVllm(FAKE_MODEL, Timing(num_tokens=4, itl_s=0.002))
    server = await serve(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        server.close()
