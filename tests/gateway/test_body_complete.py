"""A body that had all arrived when the app was called is read without the body timeout's
timer (``gateway.limits.BODY_COMPLETE_EXTENSION``): the gateway's own HTTP server says whether
it has, and the limits middleware still times out a body that has not."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.types import Message, Receive, Scope, Send

from gateway.limits import BODY_COMPLETE_EXTENSION, RequestLimits, RequestLimitsMiddleware
from tests.gateway.conftest import gateway_protocol_serving

BODY = b'{"a": 1}'


def _head(length: int) -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % length


async def test_the_server_says_whether_the_body_had_arrived_when_the_app_was_called() -> None:
    seen: list[tuple[bool, bool]] = []  # (complete at the app's call, complete after receive)
    entered = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        complete = scope["extensions"][BODY_COMPLETE_EXTENSION]
        at_call = complete()
        entered.set()
        message = await receive()
        seen.append((at_call, complete()))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": message["body"]})

    async with gateway_protocol_serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(_head(len(BODY)) + BODY)  # whole, in one write
            await asyncio.wait_for(reader.readuntil(BODY), 5)
            entered.clear()
            writer.write(_head(len(BODY)))  # the head, then the body once the app runs
            await asyncio.wait_for(entered.wait(), 5)
            writer.write(BODY)
            await asyncio.wait_for(reader.readuntil(BODY), 5)
        finally:
            writer.close()
    assert seen == [(True, True), (False, True)]


class _App:
    """Records the body and scope it was called with."""

    def __init__(self) -> None:
        self.body: bytes | None = None
        self.scope: Scope | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope = scope
        self.body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _scope(extensions: dict[str, Any]) -> Scope:
    return {"type": "http", "method": "POST", "path": "/x", "headers": [], "extensions": extensions}


async def _call(
    middleware: RequestLimitsMiddleware, scope: Scope, receive: Receive
) -> list[Message]:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    await middleware(scope, receive, send)
    return sent


async def test_a_complete_body_is_handed_on_and_the_extension_let_go() -> None:
    app = _App()
    middleware = RequestLimitsMiddleware(app, RequestLimits(body_timeout_s=0.2))

    async def receive() -> Message:
        return {"type": "http.request", "body": BODY, "more_body": False}

    sent = await _call(middleware, _scope({BODY_COMPLETE_EXTENSION: lambda: True}), receive)
    assert sent[0]["status"] == 200
    assert app.body == BODY
    assert app.scope is not None
    assert BODY_COMPLETE_EXTENSION not in app.scope["extensions"]  # not held for a stream


async def test_a_body_still_on_its_way_is_timed_out_with_or_without_the_extension() -> None:
    for extensions in ({BODY_COMPLETE_EXTENSION: lambda: False}, {}):
        app = _App()
        middleware = RequestLimitsMiddleware(app, RequestLimits(body_timeout_s=0.2))
        parts = [b'{"a"', None]  # the first part arrives, the rest never does

        async def receive(parts: list[bytes | None] = parts) -> Message:
            part = parts.pop(0)
            if part is None:
                await asyncio.Event().wait()
            return {"type": "http.request", "body": part, "more_body": True}

        sent = await asyncio.wait_for(_call(middleware, _scope(extensions), receive), 5)
        assert sent[0]["status"] == 408, extensions
        error = orjson.loads(sent[1]["body"])["error"]
        assert error["code"] == "request_timeout"
        assert "4 bytes came" in error["message"]
        assert app.body is None
