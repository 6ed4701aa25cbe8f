"""``EngineClient.open_stream``'s limits on a decode worker's stream (gateway/serving/upstream.py):
a silence past the idle timeout ends the reads, a deadline ends them, a consumer that reads
slowly is never taken for a silent worker, an error status whose body never comes is still an
error, the first event that ``read_first`` waited for is yielded once, and a stream waiting for
its next read holds no copy of the last. Against a real HTTP server that streams SSE on cue."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from core.errors import DeadlineExceededError, EngineError, EngineTimeoutError
from core.http1 import Http1Client
from core.messages import WorkerRole
from gateway.serving.upstream import EngineClient, EngineStream, UpstreamConfig
from tests.http_app import served
from workers.registry import Worker

IDLE_S = 0.3


@dataclass
class Script:
    """What the server sends: ``burst`` events at once; then, ``rounds`` times, a pause of
    ``pause_s`` (``None``: silence until the client leaves) and ``then`` events; then
    ``[DONE]``."""

    burst: int = 1
    pause_s: float | None = None
    then: int = 0
    rounds: int = 1
    status: int = 200
    """Any other: that status's head, then silence (no body) until the client leaves."""
    event_bytes: int = 64
    left: asyncio.Event = field(default_factory=asyncio.Event)


@asynccontextmanager
async def _server(script: Script) -> AsyncIterator[str]:
    async def generate(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            status=script.status, headers={"Content-Type": "text/event-stream"}
        )
        await response.prepare(request)
        event = b"data: {" + b"x" * script.event_bytes + b"}\n\n"
        if script.status == 200:
            await response.write(event * script.burst)
        if script.pause_s is None or script.status != 200:
            # Silent until the client leaves: aiohttp neither cancels the handler nor offers
            # an event for that.
            transport = request.transport
            while transport is not None and not transport.is_closing():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
            script.left.set()
            return response
        for _ in range(script.rounds):
            await asyncio.sleep(script.pause_s)
            await response.write(event * script.then)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", generate)
    async with served(app) as base_url:
        yield base_url


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    engine = EngineClient(UpstreamConfig(decode_idle_timeout_s=IDLE_S, first_byte_timeout_s=5))
    await engine.start()
    yield engine
    await engine.aclose()


@asynccontextmanager
async def _open(client: EngineClient, script: Script) -> AsyncIterator[EngineStream]:
    async with _server(script) as base_url:
        worker = Worker("decode-0", WorkerRole.DECODE, base_url, healthy=True)
        stream = await client.open_stream(worker, "/v1/chat/completions", {}, "req-1")
        try:
            yield stream
        finally:
            stream.close()


async def _drain(events: AsyncIterator[bytes]) -> int:
    return sum([1 async for _ in events])


async def test_a_worker_silent_past_the_idle_timeout_ends_the_stream(client: EngineClient) -> None:
    script = Script(burst=3, pause_s=None)
    async with _open(client, script) as stream:
        started = time.monotonic()
        events = stream.events()
        received = [await anext(events) for _ in range(3)]
        assert len(received) == 3
        with pytest.raises(EngineTimeoutError, match="went silent mid-stream"):
            await asyncio.wait_for(anext(events), IDLE_S * 20)
        silent_s = time.monotonic() - started
        assert IDLE_S * 0.9 <= silent_s < IDLE_S * 5, silent_s
        await events.aclose()
    await asyncio.wait_for(script.left.wait(), 5)  # the connection was dropped


async def test_events_on_time_keep_the_stream_alive_past_the_idle_timeout(
    client: EngineClient,
) -> None:
    # Three pauses, each under the idle timeout, together well past it.
    script = Script(burst=1, pause_s=IDLE_S * 0.6, then=1, rounds=3)
    async with _open(client, script) as stream:
        assert await _drain(stream.events()) == 4


async def test_a_consumer_that_reads_slowly_is_not_a_silent_worker(client: EngineClient) -> None:
    # The worker sends everything at once; the consumer reads one event, then nothing for
    # twice the idle timeout while the rest waits unread in the client's buffer.
    script = Script(burst=1, pause_s=0.01, then=50)
    async with _open(client, script) as stream:
        events = stream.events()
        await anext(events)
        await asyncio.sleep(IDLE_S * 2)
        assert await _drain(events) == 50


async def test_the_deadline_ends_a_stream_before_its_idle_timeout(client: EngineClient) -> None:
    script = Script(burst=1, pause_s=None)
    async with _open(client, script) as stream:
        events = stream.events(deadline=time.monotonic() + IDLE_S / 3)
        await anext(events)
        with pytest.raises(DeadlineExceededError):  # not the silence's EngineTimeoutError
            await asyncio.wait_for(anext(events), IDLE_S * 10)
        await events.aclose()


async def test_a_deadline_already_past_ends_the_stream_at_once(client: EngineClient) -> None:
    script = Script(burst=1, pause_s=None)
    async with _open(client, script) as stream:
        events = stream.events(deadline=time.monotonic() - 1)
        assert await anext(events)  # the first event was read before the stream was handed on
        with pytest.raises(DeadlineExceededError):
            await asyncio.wait_for(anext(events), IDLE_S * 10)
        await events.aclose()


async def test_an_error_status_whose_body_never_comes_is_still_an_error(
    client: EngineClient,
) -> None:
    script = Script(status=500)
    async with _server(script) as base_url:
        worker = Worker("decode-0", WorkerRole.DECODE, base_url, healthy=True)
        with pytest.raises(EngineError) as caught:
            await asyncio.wait_for(
                client.open_stream(worker, "/v1/chat/completions", {}, "req-1"), IDLE_S * 20
            )
        assert caught.value.status_code == 502


async def test_events_without_read_first_yield_each_event_once() -> None:
    script = Script(burst=2, pause_s=0.01, then=1)
    async with _server(script) as base_url:
        worker = Worker("decode-0", WorkerRole.DECODE, base_url, healthy=True)
        http = Http1Client(connect_timeout_s=5)
        try:
            response = await http.post(base_url, "/v1/chat/completions", b"{}", ())
            stream = EngineStream(response, worker, IDLE_S)
            try:
                assert await _drain(stream.events()) == 3
            finally:
                stream.close()
        finally:
            await http.aclose()


async def test_a_stream_waiting_for_its_next_read_holds_nothing_of_the_last(
    client: EngineClient,
) -> None:
    # An open stream spends most of its life in that wait: a copy of its last read held there
    # (the read, its lines, the payload) is memory per open stream (docs/ARCHITECTURE.md).
    event_bytes = 200_000
    tracemalloc.start()
    try:
        async with _open(client, Script(burst=1, pause_s=None, event_bytes=event_bytes)) as stream:
            events = stream.events()
            assert len(await anext(events)) > event_bytes
            waiting = asyncio.ensure_future(anext(events))
            await asyncio.sleep(0.05)  # in the read's wait now (the worker stays silent)
            assert not waiting.done()
            held = sum(
                stat.size
                for stat in tracemalloc.take_snapshot().statistics("filename")
                if stat.traceback[0].filename.endswith(
                    ("gateway/serving/upstream.py", "core/http1.py")
                )
            )
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
    finally:
        tracemalloc.stop()
    assert held < event_bytes / 4, held
