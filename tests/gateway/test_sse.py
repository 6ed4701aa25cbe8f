"""The stream's commit point (``gateway/serving/sse.py``): when a response starts and with what headers.

A scripted source stands in for a request: its quota answer and its first token arrive when the
test says, so "slower than one heartbeat interval" is a fact of the test, not of the machine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import Response

from core.errors import EngineError, RateLimitError, TandemError
from gateway.errors import install_error_handlers
from gateway.serving.sse import serve_stream
from tests.gateway.conftest import wait_until
from tests.server_process import free_port

PING_INTERVAL_S = 0.05
RATELIMIT = {"x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "99"}


class ScriptedSource:
    """Opens as the test releases it: first the quota's answer, then the first token."""

    def __init__(
        self, refusal: TandemError | None = None, failure: Exception | None = None
    ) -> None:
        """``refusal``: the quota's answer instead of a reservation; ``failure``: what
        happens instead of the first token."""
        self.headers = {"x-request-id": "req-1"}
        self.release_quota = asyncio.Event()
        self.release_first_token = asyncio.Event()
        self.refusal = refusal
        self.failure = failure
        self.closed = False
        self._answered = asyncio.Event()

    async def open_stream(self) -> None:
        try:
            await self.release_quota.wait()
            if self.refusal is not None:
                raise self.refusal
            self.headers.update(RATELIMIT)
        finally:
            self._answered.set()
        await self.release_first_token.wait()
        if self.failure is not None:
            raise self.failure

    async def quota_answered(self) -> None:
        await self._answered.wait()

    async def events(self) -> AsyncIterator[bytes]:
        yield b'{"choices": []}'
        yield b"[DONE]"

    async def aclose(self) -> None:
        self.closed = True


@asynccontextmanager
async def _serving(source: ScriptedSource) -> AsyncIterator[httpx.AsyncClient]:
    """``serve_stream(source)`` on a real uvicorn server (in-process ASGI transports buffer
    whole bodies and never end an SSE response)."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/stream")
    async def stream() -> Response:
        return serve_stream(source, PING_INTERVAL_S)

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            yield client
    finally:
        server.should_exit = True
        await serving


async def _release_after(event: asyncio.Event, intervals: float) -> None:
    await asyncio.sleep(PING_INTERVAL_S * intervals)
    event.set()


async def test_a_stream_committed_while_the_quota_store_is_slow_still_carries_ratelimit_headers() -> (
    None
):
    source = ScriptedSource()
    releasing = [
        asyncio.ensure_future(_release_after(source.release_quota, 4)),
        asyncio.ensure_future(_release_after(source.release_first_token, 8)),
    ]
    async with _serving(source) as client:
        response = await client.post("/stream")
    await asyncio.gather(*releasing)
    assert response.status_code == 200
    assert {name: response.headers.get(name) for name in RATELIMIT} == RATELIMIT
    # Committed before the first token: a heartbeat first, then the events.
    assert response.text.startswith(": ping\n")
    assert response.text.rstrip().endswith("data: [DONE]")
    assert source.closed


async def test_a_quota_refusal_slower_than_a_heartbeat_is_still_an_http_429() -> None:
    refusal = RateLimitError("Rate limit reached for requests.", code="rate_limit_exceeded")
    source = ScriptedSource(refusal=refusal)
    releasing = asyncio.ensure_future(_release_after(source.release_quota, 4))
    async with _serving(source) as client:
        response = await client.post("/stream")
    await releasing
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert source.closed


@pytest.mark.parametrize("quota_intervals", [0, 4])
async def test_a_request_queued_past_a_heartbeat_commits_once_the_quota_answered(
    quota_intervals: float,
) -> None:
    """Waiting in the queue or for the first token does not hold the commit back."""
    source = ScriptedSource()
    releasing = asyncio.ensure_future(_release_after(source.release_quota, quota_intervals))
    async with _serving(source) as client, client.stream("POST", "/stream") as response:
        assert response.status_code == 200
        assert response.headers["x-ratelimit-limit-requests"] == "100"
        chunks = response.aiter_text()
        assert (await anext(chunks)).startswith(": ping")
        source.release_first_token.set()
        rest = "".join([chunk async for chunk in chunks])
    await releasing
    assert "data: [DONE]" in rest


async def test_a_stream_that_opens_within_a_heartbeat_commits_with_its_first_event() -> None:
    source = ScriptedSource()
    source.release_quota.set()
    source.release_first_token.set()
    async with _serving(source) as client:
        response = await client.post("/stream")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert {name: response.headers.get(name) for name in RATELIMIT} == RATELIMIT
    assert response.text == 'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert source.closed


async def test_a_failure_after_the_stream_committed_is_its_one_error_event() -> None:
    failure = EngineError("The engine failed.", code="engine_error")
    source = ScriptedSource(failure=failure)
    source.release_quota.set()
    releasing = asyncio.ensure_future(_release_after(source.release_first_token, 4))
    async with _serving(source) as client:
        response = await client.post("/stream")
    await releasing
    assert response.status_code == 200
    events = [event for event in response.text.split("\n\n") if event]
    assert events[0] == ": ping"
    [error] = [event for event in events if event.startswith("data: ")]
    assert orjson.loads(error.removeprefix("data: ")) == failure.to_body()
    assert source.closed


async def test_a_bug_before_the_stream_committed_is_a_500_in_openai_shape() -> None:
    source = ScriptedSource(failure=RuntimeError("a bug"))
    source.release_quota.set()
    source.release_first_token.set()
    async with _serving(source) as client:
        response = await client.post("/stream")
    assert response.status_code == 500
    assert response.json()["error"]["message"].startswith("The gateway hit an internal error")
    assert source.closed
