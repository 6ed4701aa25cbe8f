"""What a request does not keep while its response streams (docs/ARCHITECTURE.md, the memory
paragraph of the hot path): its raw body once parsed, its prompt once it decodes, an event once
written, its response's headers and its own once the response started, an event object nobody
waits on, a task watching for the hang-up, a connection the client reset. Each is a copy per
open stream, or a whole connection's objects per reset one.

"Not kept" is read off the garbage collector (the test holds the object in one list of its
own, and that list must be its only referrer) or, where the object is made inside the code
under test, off tracemalloc (what is still allocated once the call returned).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import sys
import tracemalloc
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request as HttpRequest
from starlette.types import Message, Receive, Scope, Send

from core.jsonbytes import dumps_to_keep
from core.request import Request, RequestPhase
from gateway.cli.http_protocol import LeanEvent
from gateway.limits import RequestLimits, RequestLimitsMiddleware
from gateway.serving.events import ResponseHead
from gateway.serving.hangup import HANG_UP_EXTENSION, HangUpSignal
from gateway.serving.routes import _json_body
from gateway.serving.sse import EventStream
from tests.gateway.conftest import (
    MODEL,
    FakeStack,
    gateway_protocol_serving,
    live_protocols,
    wait_until,
)

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 20_000}]})


def _scope() -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-length", b"%d" % len(BODY))],
    }


def _server_hands_over(given: list[bytes]) -> Receive:
    """The server's ``receive``: the body once (a new object, recorded in ``given``), then
    nothing until the test ends."""

    async def receive() -> Message:
        if given:
            await asyncio.Event().wait()
        given.append(bytes(memoryview(BODY)))  # a copy: bytes(BODY) would be BODY itself
        return {"type": "http.request", "body": given[-1], "more_body": False}

    return receive


def _only_held_by(value: object, holder: list[Any]) -> bool:
    gc.collect()
    return gc.get_referrers(value) == [holder]


async def test_the_limits_middleware_keeps_no_body_once_the_app_has_it() -> None:
    given: list[bytes] = []
    received = asyncio.Event()
    response_ends = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert (await receive())["body"] == BODY
        received.set()
        await response_ends.wait()  # a long stream: the middleware's frame suspended above

    middleware = RequestLimitsMiddleware(app, RequestLimits())
    serving = asyncio.create_task(middleware(_scope(), _server_hands_over(given), _no_send))
    await received.wait()
    kept_nowhere = _only_held_by(given[0], given)  # (an assert's own temporaries would hold it)
    response_ends.set()
    await serving
    assert kept_nowhere


async def test_parsing_the_body_leaves_no_copy_on_the_request() -> None:
    async def receive() -> Message:  # unlike _server_hands_over, keeps nothing itself
        return {"type": "http.request", "body": bytes(memoryview(BODY)), "more_body": False}

    request = HttpRequest(_scope(), receive)
    tracemalloc.start()
    try:
        body = await _json_body(request)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert body["messages"][0]["content"] == "x" * 20_000
    # The parsed prompt is the one copy; body() would have kept another on `request`.
    assert held < 1.5 * len(BODY), held


async def test_a_decoding_stream_holds_no_prompt(fake_stack: FakeStack) -> None:
    fake_stack.decode.token_delay_s = 0.2
    prompt = "a prompt " * 60
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=4
    )
    async with stream:
        await anext(aiter(stream))  # the first token: the stream decodes
        decoding = [
            held
            for held in gc.get_objects()
            if isinstance(held, Request) and held.phase is RequestPhase.DECODING
        ]
        assert len(decoding) == 1
        assert decoding[0].prompt.texts == () and decoding[0].prompt.raw is None
        assert "messages" not in decoding[0].body
        async for _ in stream:
            pass


async def test_an_event_written_is_not_held_while_the_next_is_awaited() -> None:
    payloads: list[bytes] = []
    written = asyncio.Event()
    next_event = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        payloads.append(orjson.dumps({"choices": [{"delta": {"content": "hi"}}]}))
        yield payloads[-1]
        await next_event.wait()  # the stream suspended between two tokens
        yield b"[DONE]"

    async def send(message: Message) -> None:
        if message.get("body", b"").startswith(b"data: {"):
            written.set()

    stream = EventStream(events(), {}, 0, _nothing_to_close)
    streaming = asyncio.create_task(stream({"type": "http"}, _never_leaves, send))
    await written.wait()
    kept_nowhere = _only_held_by(payloads[0], payloads)
    next_event.set()
    await streaming
    assert kept_nowhere


async def test_a_stream_lets_go_of_its_and_its_requests_headers_once_sent() -> None:
    sent: list[Message] = []
    next_event = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        yield b'{"choices": []}'
        await next_event.wait()

    async def send(message: Message) -> None:
        sent.append(message)

    headers = {f"x-ratelimit-{n}": "1000" for n in range(6)}
    stream = EventStream(events(), headers, 0, _nothing_to_close)
    request = HttpRequest({"type": "http", "headers": [(b"x-stainless-os", b"Linux")]})
    assert request.headers["x-stainless-os"] == "Linux"  # read by the route, as it parses
    streaming = asyncio.create_task(stream(request.scope, _never_leaves, send))
    await wait_until(lambda: len(sent) == 2)  # the start and the first event
    assert (b"x-ratelimit-0", b"1000") in sent[0]["headers"]
    assert stream.raw_headers == []
    # The request's headers too, in the scope and in the request object's view of them.
    assert request.scope["headers"] == [] and dict(request.headers) == {}
    next_event.set()
    await streaming


async def test_a_response_head_makes_an_event_only_for_a_waiter() -> None:
    head = ResponseHead({})
    head.quota_reserved({"x-ratelimit-limit-tokens": "100"})
    await head.quota_answered()  # answered already: nothing to wait on, nothing made
    assert head._answered is None

    waiting = ResponseHead({})
    waiter = asyncio.create_task(waiting.quota_answered())
    await asyncio.sleep(0)
    assert not waiter.done()
    waiting.admission_ended(None)
    await asyncio.wait_for(waiter, 1)


async def test_the_servers_hang_up_signal_fires_and_is_not_kept_past_the_response() -> None:
    """The gateway's own server tells a request its client left (no task waiting on
    ``receive()``), and a kept-alive connection holds no signal of a finished request."""
    signals: list[HangUpSignal] = []
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        signals.append(scope["extensions"][HANG_UP_EXTENSION])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/wait":
            await release.wait()  # a stream the client leaves
        await send({"type": "http.response.body", "body": b"ok"})

    async with gateway_protocol_serving(app) as port:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(3):
                writer.write(b"GET / HTTP/1.1\r\nHost: tandem\r\n\r\n")
                answer = b""
                while not answer.endswith(b"\r\n0\r\n\r\n"):
                    answer += await reader.read(4096)
            (protocol,) = live_protocols(port)
            assert protocol._conn.hang_ups == []  # three requests answered, none still held
            assert not any(signal.fired for signal in signals)

            writer.write(b"GET /wait HTTP/1.1\r\nHost: tandem\r\n\r\n")
            await wait_until(lambda: len(signals) == 4)
            writer.close()  # the client leaves mid-response
            await wait_until(lambda: signals[3].fired)
            assert not any(signal.fired for signal in signals[:3])
        finally:
            release.set()  # before the server stops: it waits for its requests


def test_a_kept_document_is_its_own_length() -> None:
    document = {"choices": [{"index": 0, "delta": {"content": "hello"}}]}
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = dumps_to_keep(document)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept == orjson.dumps(document)
    assert grown < len(kept) + 128, grown  # orjson's own bytes hold 4 KiB at the least


async def test_a_connection_the_client_resets_is_let_go_at_once() -> None:
    """uvicorn disarms its keep-alive timer only on a clean close; after a reset the timer
    held the connection's protocol for the whole keep-alive timeout (60 s here)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with gateway_protocol_serving(app, timeout_keep_alive=60) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: tandem\r\n\r\n")
        answer = b""
        while not answer.endswith(b"\r\n0\r\n\r\n"):  # the whole response: kept alive now
            answer += await reader.read(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        assert _protocols() == 1
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # SO_LINGER 0: the close is a reset
        await wait_until(lambda: _protocols() == 0, timeout_s=5.0)


async def test_a_lean_event_wakes_its_waiters_as_an_event_does() -> None:
    event = LeanEvent()
    waiters = [asyncio.ensure_future(event.wait()) for _ in range(3)]
    leaving = asyncio.ensure_future(event.wait())
    await asyncio.sleep(0)
    leaving.cancel()  # a waiter that gives up leaves the waiters
    await asyncio.wait((leaving,))
    assert len(event._waiters) == 3 and type(event._waiters) is list
    event.set()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 1) == [True, True, True]
    assert event._waiters == []
    assert await event.wait()  # set: returns at once
    event.clear()
    later = asyncio.ensure_future(event.wait())
    await asyncio.sleep(0)
    assert not later.done()
    event.set()
    assert await asyncio.wait_for(later, 1)


async def test_an_open_connection_holds_no_deque_and_still_pipelines_and_drains() -> None:
    """uvicorn's three per-connection deques (0.75 KiB each, for a stream's whole life) are
    lists here; pipelined requests are still answered in order, and a response larger than
    the socket's buffers still waits for a slow reader (the flow control's event)."""
    big = b"x" * (8 * 1024 * 1024)
    release = asyncio.Event()
    waiting = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        if scope["path"] == "/wait":
            waiting.set()
            await release.wait()
        body = big if scope["path"] == "/big" else scope["path"].encode()
        await send({"type": "http.response.body", "body": body})

    async with gateway_protocol_serving(app) as port:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(
                b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\nGET /next HTTP/1.1\r\nHost: t\r\n\r\n"
            )
            await asyncio.wait_for(waiting.wait(), 5)
            (protocol,) = live_protocols(port)
            deques = [
                value
                for holder in (protocol, protocol.flow, protocol.cycle)
                for value in vars(holder).values()
                if isinstance(value, deque)
            ]
            waiters = (protocol.flow._is_writable_event, protocol.cycle.message_event)
            assert deques == [] and all(isinstance(e, LeanEvent) for e in waiters)
            await wait_until(lambda: len(protocol.pipeline) == 1)  # /next waits its turn
            release.set()
            answers = b""
            while answers.count(b"\r\n0\r\n\r\n") < 2:
                answers += await reader.read(65536)
            assert answers.index(b"/wait") < answers.index(b"/next")

            writer.write(b"GET /big HTTP/1.1\r\nHost: t\r\n\r\n")
            await wait_until(lambda: protocol.flow.write_paused)  # nobody reads: it waits
            received = 0
            while received < len(big):
                received += len(await reader.read(1 << 20))
            await wait_until(lambda: not protocol.flow.write_paused)
        finally:
            release.set()


async def test_on_the_server_a_streams_request_headers_are_held_nowhere_once_it_started() -> None:
    next_event = asyncio.Event()
    seen: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        yield b'{"choices": []}'
        await next_event.wait()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        seen.append(HttpRequest(scope, receive).headers["x-stainless-os"])  # as a route reads
        await EventStream(events(), {}, 0, _nothing_to_close)(scope, receive, send)

    async with gateway_protocol_serving(app) as port:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /s HTTP/1.1\r\nHost: t\r\nX-Stainless-OS: Linux\r\n\r\n")
            await asyncio.wait_for(reader.readuntil(b"data: "), 5)  # the first event
            (protocol,) = live_protocols(port)
            assert seen == ["Linux"]
            assert protocol.scope["headers"] == [] and protocol.headers == []
            writer.close()
        finally:
            next_event.set()


async def test_an_open_connections_attributes_share_their_keys() -> None:
    """CPython shares the keys of instances' attribute dicts only up to 30 attributes: past
    that, every connection would hold a dict of its own (about 1.5 KiB) for its whole life."""
    release = asyncio.Event()
    waiting = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            waiting.set()
            await release.wait()
            await send({"type": "http.response.body", "body": b"done"})

    async with gateway_protocol_serving(app) as port:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
            await asyncio.wait_for(waiting.wait(), 5)
            (protocol,) = live_protocols(port)
            assert sys.getsizeof(vars(protocol)) < 512, sorted(vars(protocol))
            writer.close()
        finally:
            release.set()


def _protocols() -> int:
    return len(live_protocols())


async def _never_leaves() -> Message:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _nothing_to_close() -> None:
    return None


async def _no_send(message: Message) -> None:
    raise AssertionError(f"nothing is answered here, got {message['type']}")
