"""A lean HTTP/1.1 client for the gateway's calls to its workers: a JSON ``POST`` per call
over kept-alive connections, written in one go, its response parsed as it arrives.

aiohttp (which the gateway keeps for everything else it reads from workers: health, metrics)
spent 0.16 ms of a request's time to first token before the request's first byte left, at one
stream at a time: its request, URL, timeout, cookie and header objects built per call, cold in
the CPU's caches (``python -m bench.overhead.ttft_steps``). Here a call is one header block
formatted, one write, and httptools' C parser (uvicorn's) fed each read.

The contract:

- A worker's base URL is ``http(s)://host[:port][/path-prefix]`` (``worker_url`` checks and
  trims one where it is configured); a request's path goes under its prefix, as the health
  and metrics reads' do.
- ``Http1Client.post`` returns once the response's status line and headers are in; the body
  is then read with ``Http1Response.read`` (all of it) or ``read_some`` (what has arrived).
- A response read to its end gives its connection back for the next call (unless the server
  said ``Connection: close``). ``close()`` before that drops the connection: the server sees
  its client leave (vLLM aborts the request). A cancelled ``post`` drops it too.
- Connections idle longer than ``idle_s`` are not used again, and are closed when another
  connection to their origin comes back: ``idle_s`` sits below uvicorn's own keep-alive
  (5 s), so the server never closes a connection this client is about to use. A
  connection used before that fails with nothing received is tried once more on a new one
  (the server closed it as the request went out, so it never read the request).
- Errors are ``OSError``s: ``TimeoutError`` when no connection opens within the connect
  timeout, ``ConnectionError`` (``HttpConnectionError``) for a refused, reset or closed
  connection and for a malformed response. ``fail(exc)`` ends a response's reads with
  ``exc`` (a caller's watchdog).
- An ``https://`` worker's certificate and name are verified against the system's
  authorities (``ssl.create_default_context``, as aiohttp did): ``SSL_CERT_FILE`` or
  ``SSL_CERT_DIR`` in the gateway's environment names a private CA's instead. A certificate
  that fails is an ``HttpConnectionError`` saying so.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools

_PAUSE_AT = 256 * 1024
"""Bytes received and not yet read at which the socket stops being read (resumed when read)."""


class HttpConnectionError(ConnectionError):
    """The connection failed, closed before the response ended, or carried no valid HTTP."""


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a worker listens: ``http://host:port`` or ``https://...``."""

    host: str
    port: int
    tls: bool

    @classmethod
    def of(cls, base_url: str) -> Origin:
        """The origin of a base URL ``worker_url`` accepts; ValueError, saying why, otherwise."""
        return _split(base_url)[0]

    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def worker_url(value: str) -> str:
    """``value`` as a worker's base URL, checked where it is configured (settings, the stack
    file, the admin API): ``http(s)://host[:port][/prefix]``, trimmed, without a trailing
    ``/`` (the gateway appends ``/v1/...`` to it). ValueError, saying what is accepted."""
    url = value.strip().rstrip("/")
    _split(url)
    return url


def _split(base_url: str) -> tuple[Origin, str]:
    """(the origin, the path prefix every request's path goes under: "" or ``/...``)."""
    accepted = "a worker's URL is http(s)://host[:port][/path-prefix]"
    try:
        parts = urlsplit(base_url)
        port = parts.port
    except ValueError as exc:  # a port that is not a number, or out of range
        raise ValueError(f"{accepted}, not {base_url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{accepted}, not {base_url!r}")
    if parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"{accepted}, without a query, fragment or user: not {base_url!r}")
    tls = parts.scheme == "https"
    return Origin(parts.hostname, port or (443 if tls else 80), tls), parts.path.rstrip("/")


class Http1Response:
    """A response whose head has arrived; its body is read as it comes."""

    __slots__ = (
        "_body", "_buffered", "_complete", "_connection", "_error", "_waiter", "bytes_received",
        "status",
    )  # fmt: skip

    def __init__(self, connection: _Connection, status: int) -> None:
        self._connection: _Connection | None = connection
        self.status = status
        # A list, not a deque: an empty deque is 0.75 KiB, held for a stream's whole life; a
        # cleared list is 56 bytes, and it only ever holds the few reads since the last one.
        self._body: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.bytes_received = 0
        """Body bytes received so far, read or not."""

    async def read_some(self) -> bytes:
        """The body bytes that arrived since the last read (waiting for some); ``b""`` once
        the body has ended. Raises what ended it otherwise."""
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        self._buffered = 0
        if self._connection is not None:
            self._connection.resume()
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while data := await self.read_some():
            parts.append(data)
        return b"".join(parts)

    def fail(self, error: BaseException) -> None:
        """End the reads with ``error``: the next ``read_some`` (or the waiting one) raises it
        once what arrived before was read."""
        if self._error is None and not self._complete:
            self._error = error
            self._wake()

    def close(self) -> None:
        """Done with it: a connection whose response was read to its end goes back to the
        pool; otherwise it is dropped."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.let_go(reusable=False)

    # -- fed by the connection -----------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        self._body.append(data)
        self._buffered += len(data)
        self.bytes_received += len(data)
        if self._buffered >= _PAUSE_AT and self._connection is not None:
            self._connection.pause()
        self._wake()

    def _lost(self, error: BaseException) -> None:
        self._connection = None  # closed already
        self.fail(error)

    def _ended(self, reusable: bool) -> None:
        self._complete = True
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.let_go(reusable)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _Connection(asyncio.Protocol):
    """One connection, one request at a time; httptools calls the ``on_*`` methods."""

    __slots__ = (
        "_client", "_head", "_length_known", "_parser", "_paused", "_response", "closed",
        "idle_since", "origin", "received_any", "transport",
    )  # fmt: skip

    def __init__(self, client: Http1Client, origin: Origin) -> None:
        self._client = client
        self.origin = origin
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.closed = False
        self.received_any = False
        self._head: asyncio.Future[Http1Response] | None = None
        self._response: Http1Response | None = None
        self._length_known = False
        self._paused = False

    def send(self, data: Iterable[bytes]) -> asyncio.Future[Http1Response]:
        assert self.transport is not None, "sent on a connection not yet made"
        assert self._head is None, "one request at a time"
        assert self._response is None, "one request at a time"
        self.received_any = False
        self._length_known = False
        self._head = asyncio.get_running_loop().create_future()
        self.transport.writelines(data)
        return self._head

    def let_go(self, reusable: bool) -> None:
        """Its response is done with: pooled again when ``reusable``, else closed."""
        self._response = None
        if reusable and not self.closed:
            self.resume()
            self._client.give_back(self)
        else:
            self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        if self._head is None and self._response is None:
            self._fail(HttpConnectionError("the worker sent bytes no request asked for"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpConnectionError(f"the worker's answer is not valid HTTP: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._client.forget(self)
        response = self._response
        if response is not None and not self._length_known and exc is None:
            self._response = None
            response._ended(reusable=False)  # a body that ends with its connection
            return
        reason = f": {exc}" if exc is not None else ""
        self._fail(HttpConnectionError(f"the worker closed the connection{reason}"))

    # -- httptools' callbacks ------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        # Only whether the body's end is marked (a length, or chunks) rather than by the
        # connection closing; no caller reads the headers.
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._length_known = True

    def on_headers_complete(self) -> None:
        head, self._head = self._head, None
        response = Http1Response(self, self._parser.get_status_code())
        self._response = response
        if head is not None and not head.done():
            head.set_result(response)
        else:  # the caller left (cancelled) as the head came: nobody reads this response
            response.close()

    def on_body(self, body: bytes) -> None:
        if self._response is not None:
            self._response._feed(body)

    def on_message_complete(self) -> None:
        if self._response is not None:
            self._response._ended(self._parser.should_keep_alive())

    def _fail(self, error: HttpConnectionError) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        response, self._response = self._response, None
        if response is not None:
            response._lost(error)
        self.close()


class Http1Client:
    """Kept-alive HTTP/1.1 connections to the workers, per origin; ``aclose()`` at the end."""

    def __init__(self, connect_timeout_s: float, idle_s: float = 4.0) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self._connect_timeout_s = connect_timeout_s
        self._idle_s = idle_s
        self._idle: dict[Origin, deque[_Connection]] = {}
        """Per origin, the idle connections, oldest first."""
        self._targets: dict[str, tuple[Origin, str]] = {}
        """Per base URL, its origin and path prefix."""
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def target(self, base_url: str) -> tuple[Origin, str]:
        """``base_url``'s origin and path prefix; ValueError for a URL ``worker_url`` refuses."""
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _split(base_url)
        return target

    async def post(
        self, base_url: str, path: str, body: bytes, headers: Iterable[tuple[str, str]]
    ) -> Http1Response:
        """POST ``body`` (JSON) to ``base_url + path``; the response once its head is in."""
        if self._closed:
            raise RuntimeError("the client is closed")
        origin, prefix = self.target(base_url)
        lines = [f"POST {prefix}{path} HTTP/1.1\r\nHost: {origin.host_header()}\r\n"]
        for name, value in headers:
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} has a line break in its value")
            lines.append(f"{name}: {value}\r\n")
        lines.append(f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        data = ("".join(lines).encode("latin-1"), body)
        connection = self._reused(origin)
        if connection is not None:
            try:
                return await self._exchange(connection, data)
            except HttpConnectionError:
                if connection.received_any:
                    raise
                # Closed by the server as the request went out: it never read it.
        return await self._exchange(await self._connect(origin), data)

    async def _exchange(self, connection: _Connection, data: tuple[bytes, bytes]) -> Http1Response:
        head = connection.send(data)
        try:
            return await head
        except BaseException:
            if head.done() and not head.cancelled() and head.exception() is None:
                # The head came as the caller left: only its response is let go. Its
                # connection may be back in the pool already (the whole answer came), even
                # serving another request, which closing it here would break.
                head.result().close()
            else:
                connection.close()
            raise

    def _reused(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the warmest
            if not connection.closed and now - connection.idle_since < self._idle_s:
                return connection
            connection.close()
        return None

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if origin.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, origin), origin.host, origin.port, ssl=tls
                )
        except TimeoutError:
            raise TimeoutError(
                f"no connection to {origin.host_header()} within {self._connect_timeout_s} s"
            ) from None
        except OSError as exc:
            raise HttpConnectionError(
                f"cannot connect to {origin.host_header()}: {exc.strerror or exc}"
            ) from exc
        self._open.add(connection)
        return connection

    def give_back(self, connection: _Connection) -> None:
        if self._closed:
            connection.close()
            return
        now = connection.idle_since = time.monotonic()
        idle = self._idle.setdefault(connection.origin, deque())
        idle.append(connection)
        # Those idle too long go now: after a burst, its connections are not held open until
        # the server closes them (or for ever, where it never does).
        while now - idle[0].idle_since >= self._idle_s:
            idle.popleft().close()

    def forget(self, connection: _Connection) -> None:
        """A closed connection: out of the pool."""
        self._open.discard(connection)
        idle = self._idle.get(connection.origin)
        if idle and connection in idle:
            idle.remove(connection)

    async def aclose(self) -> None:
        """Close every connection (responses still being read end with an error)."""
        self._closed = True
        self._idle.clear()
        for connection in list(self._open):
            connection.close()
        self._open.clear()
