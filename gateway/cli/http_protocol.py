"""The gateway's HTTP/1.1 protocol: uvicorn's httptools one, with limits on a request's head.

httptools accepts a request line and headers of any size (measured: 4 MB of one header was
read and handed on) and uvicorn gives a request no time limit until its headers are complete,
so one client could grow a connection's buffer without end, or hold a connection open by
sending a header a byte a minute. This protocol refuses, in OpenAI's error shape, and closes
the connection:

- a head larger than ``RequestLimits.max_header_bytes``: 431 ``headers_too_large``, counted as
  the bytes arrive (a header that never ends is refused once the limit is passed, not when it
  ends);
- a head not complete ``RequestLimits.header_timeout_s`` after the connection opened, or after
  the first byte of a later request on it: 408 ``request_timeout``.

A request the parser cannot read at all is uvicorn's 400, in the same error shape. The body's
limits are the app's (``gateway/limits.py``).

It also tells a request at once that its client hung up: each request's scope carries a
``HangUpSignal`` (``gateway/serving/hangup.py``), fired when the connection is lost before the
response completed. Without it, every request would need a task of its own waiting on
``receive()`` for the disconnect, created and cancelled twice a request and held for a
stream's whole life. And each scope says whether the request's body had all arrived when
the app was called (``gateway.limits.BODY_COMPLETE_EXTENSION``), so the limits middleware
arms its body timeout only for a body still on its way.

And it holds less per open connection: uvicorn gives each one three ``collections.deque``s
(its pipeline of queued requests, and the waiters of two ``asyncio.Event``s: the flow
control's and the request cycle's), each 0.75 KiB even when empty, for a stream's whole life;
here they are lists (``LeanEvent``, ``_Pipeline``), 56 bytes empty. Its own state is one
attribute (``_ConnectionState``): CPython shares the keys of instances' attribute dicts only up
to 30 attributes, and uvicorn's protocol has 28; five more gave every connection a dict of its
own, 1.5 KiB against 0.3.

And a response's head goes out with its first body bytes (``HeadWithBody``): one write, one
packet and one wake-up of the client where uvicorn makes two. On loopback each write is a
system call that delivers the packet and wakes the reader, tens of microseconds on the path
to a stream's first token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from core.errors import HeadersTooLargeError, InvalidRequestError, RequestTimeoutError, TandemError
from gateway.limits import BODY_COMPLETE_EXTENSION, RequestLimits
from gateway.serving.hangup import HANG_UP_EXTENSION, HangUpSignal

log = logging.getLogger("tandem.gateway")


class LeanEvent(asyncio.Event):
    """An ``asyncio.Event`` whose waiters are a list, not a deque: an empty deque is 0.75 KiB
    and an empty list 56 bytes. ``Event`` only appends its waiters, iterates over them and
    removes each one (``tests/gateway/test_held_memory.py`` pins that it behaves alike)."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: list[asyncio.Future[bool]] = []  # type: ignore[assignment]


class _Pipeline(list[Any]):
    """uvicorn's queue of pipelined requests as a list (it only ``appendleft``s and
    ``pop``s): almost always empty, for the connection's whole life."""

    def appendleft(self, item: Any) -> None:
        self.insert(0, item)


@dataclass(slots=True)
class _ConnectionState:
    """What the protocol adds to uvicorn's, per connection."""

    reading_head: bool = True
    head_bytes: int = 0
    head_timer: asyncio.TimerHandle | None = None
    refused: bool = False
    hang_ups: list[HangUpSignal] = field(default_factory=list)
    """The hang-up signals of this connection's requests whose responses are not complete,
    oldest first (more than one only when a client pipelines). A list: an empty deque is 0.75
    KiB, held for the connection's life."""


class HeadWithBody:
    """A request cycle's transport until its response's head is out: the first write (the
    head, which uvicorn writes alone as the app sends ``http.response.start``) is held until
    the next write, in the same turn of the event loop, and both go out in one ``write``. A
    response whose body does not follow at once (a stream still waiting for its first event)
    has its head written alone at the end of that turn. Then the cycle gets its transport back:
    nothing of this stays on the response's path.

    uvicorn's cycle calls ``write``, ``close`` and ``is_closing`` on its transport; a 100
    Continue (written before the head, while the client waits to send its body) is held only
    to the end of the turn too."""

    __slots__ = ("_cycle", "_held", "_transport")

    def __init__(self, cycle: RequestResponseCycle, transport: asyncio.Transport) -> None:
        self._cycle = cycle
        self._transport = transport
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is None:
            self._held = data
            asyncio.get_running_loop().call_soon(self._flush)
            return
        held, self._held = self._held, None
        self._let_go()
        self._transport.writelines((held, data))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def _flush(self) -> None:
        """The end of the turn: the held bytes go out alone (if the cycle still has them)."""
        held, self._held = self._held, None
        if held is not None:
            self._let_go()
            if not self._transport.is_closing():
                self._transport.write(held)

    def _let_go(self) -> None:
        self._cycle.transport = self._transport


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """httptools' protocol with ``limits`` on the request head (one subclass per limits:
    ``limited_httptools``)."""

    limits: ClassVar[RequestLimits] = RequestLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._conn = _ConnectionState()  # one attribute: see the module's docstring
        self.pipeline = _Pipeline()  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        _lean_writable_event(self.flow)
        self._start_head_timer()  # a connection that never sends a request is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)
        hang_ups, self._conn.hang_ups = self._conn.hang_ups, []
        for signal in hang_ups:
            signal.fire()
        # uvicorn disarms its keep-alive timer only on a clean close: after a reset (a client
        # that leaves with the rest of a response unread) the timer kept the protocol, its
        # transport and buffers alive for the whole keep-alive timeout.
        self._unset_keepalive_if_required()

    def data_received(self, data: bytes) -> None:
        if self._conn.refused:
            return  # the refusal is written and the connection closing: the rest is not read
        if self._conn.reading_head:
            if self._conn.head_timer is None:
                self._start_head_timer()  # the next request on a kept-alive connection
            self._conn.head_bytes += len(data)
        super().data_received(data)
        if (
            not self._conn.refused
            and self._conn.reading_head
            and self._conn.head_bytes > self.limits.max_header_bytes
        ):
            self._refuse(_headers_too_large(self.limits.max_header_bytes))

    def on_headers_complete(self) -> None:
        if self._conn.refused:
            return
        # The whole head may have come in one read, past the limit: measure what was parsed.
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(_headers_too_large(self.limits.max_header_bytes))
            return
        self._conn.reading_head = False
        self._stop_head_timer()
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # a request the app will see (not an upgrade)
            # Nothing waits on the cycle's event yet: its task has not started.
            self.cycle.message_event = LeanEvent()
            self.cycle.transport = HeadWithBody(self.cycle, self.transport)  # type: ignore[assignment]
            # The scope holds the request's headers for the app; the protocol's own reference
            # (uvicorn keeps it until the next request) would keep them for a stream's whole
            # life after the response let go of them (gateway/serving/sse.py).
            self.headers = []
            signal = HangUpSignal()
            extensions: dict[str, Any] = dict(self.scope.get("extensions", {}))
            extensions[HANG_UP_EXTENSION] = signal
            extensions[BODY_COMPLETE_EXTENSION] = _body_complete(self.cycle)
            self.scope["extensions"] = extensions
            self._conn.hang_ups.append(signal)

    def on_response_complete(self) -> None:
        if self._conn.hang_ups:
            del self._conn.hang_ups[0]
        super().on_response_complete()

    def on_body(self, body: bytes) -> None:
        if not self._conn.refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._conn.refused:
            return
        super().on_message_complete()
        self._conn.reading_head = True  # what comes next on this connection is another request
        self._conn.head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        # httptools could not parse the request (uvicorn logged it): its 400, in OpenAI's shape.
        self._refuse(InvalidRequestError(f"{msg} Send a valid HTTP/1.1 request."), quiet=True)

    def _start_head_timer(self) -> None:
        self._conn.head_timer = self.loop.call_later(
            self.limits.header_timeout_s, self._head_too_slow
        )

    def _stop_head_timer(self) -> None:
        if self._conn.head_timer is not None:
            self._conn.head_timer.cancel()
            self._conn.head_timer = None

    def _head_too_slow(self) -> None:
        self._conn.head_timer = None
        if self._conn.reading_head and not self._conn.refused:
            self._refuse(
                RequestTimeoutError(
                    "The request line and headers did not arrive within "
                    f"{self.limits.header_timeout_s:g} s (TANDEM_HEADER_TIMEOUT_S)."
                )
            )

    def _refuse(self, error: TandemError, *, quiet: bool = False) -> None:
        """Answer ``error`` and close the connection; nothing more is read from it."""
        self._conn.refused = True
        self._stop_head_timer()
        if not quiet:
            log.warning("refused a request from %s: %s", _address(self.client), error.message)
        if self.transport.is_closing():
            return
        body = orjson.dumps(error.to_body())
        head = [STATUS_LINE[error.status_code]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def _body_complete(cycle: RequestResponseCycle) -> Callable[[], bool]:
    """Whether ``cycle``'s request body has all been parsed (uvicorn sets ``more_body`` false
    at the message's end), so its ``receive()`` returns without waiting."""
    return lambda: not cycle.more_body


def _lean_writable_event(flow: FlowControl) -> None:
    """Give uvicorn's flow control a ``LeanEvent`` for its writable event, in the same state
    (set unless writing is paused: nothing has paused it as the connection is made)."""
    writable = LeanEvent()
    if not flow.write_paused:
        writable.set()
    flow._is_writable_event = writable


def limited_httptools(limits: RequestLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class uvicorn's ``Config(http=...)`` takes, enforcing ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def _headers_too_large(limit: int) -> HeadersTooLargeError:
    return HeadersTooLargeError(
        f"The request line and headers are larger than the {limit} bytes this gateway accepts "
        "(TANDEM_MAX_HEADER_BYTES)."
    )


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown address"
