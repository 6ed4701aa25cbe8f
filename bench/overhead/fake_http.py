"""A minimal HTTP/1.1 server on a raw ``asyncio.Protocol``, for the benchmark's fake engine.

Only what the fake engine's clients send: keep-alive connections (aiohttp and httpx pools),
requests one at a time per connection, bodies with ``Content-Length`` or chunked encoding.
Responses are whole bodies with ``Content-Length`` or chunked streams. No framework on the way,
so a streamed event costs one ``transport.write`` of bytes the engine prepared in advance: the
load generator shares a core with the engine, and every microsecond spent here is one the
measurement of the server under test cannot use.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}
_MAX_HEADER_BYTES = 64 * 1024


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    body: bytes


Handler = Callable[[HttpRequest, "Exchange"], None]
"""Called once per request; answers through the exchange, now or later (timers)."""


class Exchange:
    """One request's response: a whole body, or a chunked stream written event by event."""

    __slots__ = ("_conn", "_done", "on_abort")

    def __init__(self, conn: HttpConnection) -> None:
        self._conn = conn
        self._done = False
        self.on_abort: Callable[[], None] | None = None
        """Called if the client goes away before the response ended (cancel timers here)."""

    @property
    def open(self) -> bool:
        return not self._done and self._conn.transport is not None

    def send(self, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
        """The whole response at once."""
        head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
            status,
            _REASONS.get(status, "Unknown").encode(),
            content_type,
            len(body),
        )
        self._write(head + body)
        self._finish()

    def start_stream(self, content_type: bytes = b"text/event-stream; charset=utf-8") -> None:
        """Status line and headers of a chunked 200 response (vLLM answers them at once)."""
        self._write(
            b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"
            % content_type
        )

    def write_chunk(self, data: bytes) -> None:
        """One chunk of the chunked body (empty data is not allowed: it would end the body)."""
        self._write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self, last: bytes = b"") -> None:
        """``last`` as a final chunk, then the chunked body's terminator, in one write."""
        self._write((b"%x\r\n%s\r\n0\r\n\r\n" % (len(last), last)) if last else b"0\r\n\r\n")
        self._finish()

    def _write(self, data: bytes) -> None:
        transport = self._conn.transport
        if transport is not None and not self._done:
            transport.write(data)

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            self._conn.response_done()

    def abort(self) -> None:
        """The connection is gone: tell the owner once."""
        if not self._done:
            self._done = True
            if self.on_abort is not None:
                self.on_abort()


class HttpConnection(asyncio.Protocol):
    """Parses requests off one connection and hands each to the handler, in order."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._buffer = bytearray()
        self._current: Exchange | None = None
        self._close_after = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP server's are

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self._current is not None:
            current, self._current = self._current, None
            current.abort()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._next()

    def response_done(self) -> None:
        self._current = None
        if self._close_after and self.transport is not None:
            self.transport.close()
            return
        self._next()

    def _next(self) -> None:
        # One request at a time: a pipelined one waits in the buffer until this one is answered.
        while self._current is None and self.transport is not None:
            request = self._parse()
            if request is None:
                return
            self._close_after = request.headers.get("connection", "").lower() == "close"
            self._current = exchange = Exchange(self)
            try:
                self._handler(request, exchange)
            except Exception:  # noqa: BLE001  # the server's one boundary: a bug is a 500, shown
                traceback.print_exc()
                if exchange.open:
                    exchange.send(500, b'{"error": {"message": "fake engine bug", "code": 500}}')

    def _parse(self) -> HttpRequest | None:
        buf = self._buffer
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _MAX_HEADER_BYTES:
                self._reject()
            return None
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            self._reject()
            return None
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        start = end + 4
        if headers.get("transfer-encoding", "").lower() == "chunked":
            decoded = _dechunk(buf, start)
            if decoded is None:
                return None
            body, consumed = decoded
        else:
            length = int(headers.get("content-length") or 0)
            if len(buf) < start + length:
                return None
            body, consumed = bytes(buf[start : start + length]), start + length
        del buf[:consumed]
        return HttpRequest(parts[0], parts[1].split("?", 1)[0], headers, body)

    def _reject(self) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self.transport.close()


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """A complete chunked body starting at ``pos``: (body, end offset), or None if incomplete."""
    body = bytearray()
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        if size == 0:
            trailer_end = buf.find(b"\r\n", eol + 2)  # no trailers expected: an empty line
            return (bytes(body), trailer_end + 2) if trailer_end >= 0 else None
        if len(buf) < eol + 2 + size + 2:
            return None
        body += buf[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2


async def serve(handler: Handler, host: str, port: int) -> asyncio.Server:
    """Listen on ``host:port`` (0: any free port); the caller closes the returned server."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(lambda: HttpConnection(handler), host, port, backlog=4096)
