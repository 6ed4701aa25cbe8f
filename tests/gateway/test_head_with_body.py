"""A response's head goes out with its first body bytes, in one write
(``HeadWithBody``, ``gateway/cli/http_protocol.py``), and only when they follow at once:
a response whose body waits still shows its head, a 100 Continue still reaches a client that
waits for it, and the cycle writes to its own transport once the head is out."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from gateway.cli.http_protocol import HeadWithBody
from tests.gateway.conftest import gateway_protocol_serving, live_protocols


class _Recorded:
    """A transport that records each call that would reach the socket."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[bytes, ...]]] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", (data,)))

    def writelines(self, data: tuple[bytes, ...]) -> None:
        self.calls.append(("writelines", tuple(data)))

    def close(self) -> None:
        self.calls.append(("close", ()))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


class _Cycle:
    transport: Any = None


def _holding() -> tuple[HeadWithBody, _Recorded, _Cycle]:
    transport, cycle = _Recorded(), _Cycle()
    held = HeadWithBody(cast(RequestResponseCycle, cycle), cast(asyncio.Transport, transport))
    cycle.transport = held
    return held, transport, cycle


async def test_the_head_and_the_body_that_follows_it_at_once_are_one_write() -> None:
    held, transport, cycle = _holding()
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    assert transport.calls == []  # held: the body may follow in this turn of the loop
    held.write(b"data: 1\n\n")
    assert transport.calls == [("writelines", (b"HTTP/1.1 200 OK\r\n\r\n", b"data: 1\n\n"))]
    assert cycle.transport is transport  # the rest of the response goes straight out
    await asyncio.sleep(0)  # the end of the turn writes nothing more
    assert len(transport.calls) == 1


async def test_a_head_whose_body_waits_goes_out_alone_at_the_end_of_the_turn() -> None:
    held, transport, cycle = _holding()
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    await asyncio.sleep(0)
    assert transport.calls == [("write", (b"HTTP/1.1 200 OK\r\n\r\n",))]
    assert cycle.transport is transport


async def test_closing_writes_the_held_head_first() -> None:
    held, transport, _ = _holding()
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    held.close()
    assert transport.calls == [("write", (b"HTTP/1.1 200 OK\r\n\r\n",)), ("close", ())]
    await asyncio.sleep(0)
    assert len(transport.calls) == 2


async def test_a_head_is_not_written_to_a_transport_already_closing() -> None:
    held, transport, _ = _holding()
    held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    transport.closing = True  # the client left in this turn
    await asyncio.sleep(0)
    assert transport.calls == []


async def test_on_the_server_a_waiting_body_leaves_the_head_readable_and_the_transport_back() -> (
    None
):
    release = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await release.wait()
        await send({"type": "http.response.body", "body": b"late"})

    async with gateway_protocol_serving(app) as port:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /wait HTTP/1.1\r\nHost: t\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n")
            (protocol,) = live_protocols(port)
            assert protocol.cycle.transport is protocol.transport
            release.set()
            rest = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
            assert b"late" in rest
            writer.close()
        finally:
            release.set()


async def test_on_the_server_a_100_continue_still_reaches_a_client_that_waits_for_it() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"got " + body})

    async with gateway_protocol_serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /up HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        answer = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"got hello" in answer
        writer.close()
