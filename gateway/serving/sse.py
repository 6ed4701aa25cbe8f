"""Data-only SSE for the OpenAI SDKs, started early enough that no client or proxy times out.

A stream's HTTP status and headers are decided by when it commits. ``serve_stream`` waits up
to one heartbeat interval for the request to be admitted and its first token to arrive: errors
in that window are real HTTP statuses (429, 503, ... which the SDKs retry). A request still
queued or prefilling after it commits to ``200 text/event-stream`` and sends ``: ping``
comments while it waits; an error after that is one ``data: {"error": ...}`` event
(``docs/ARCHITECTURE.md``, "Streams"). It never commits before the quota store has answered,
however slow that is (the store's own timeout bounds it): the rate-limit headers are in every
committed stream, and a quota refusal is always an HTTP 429. Never ``event:``, ``id:`` or
``retry:`` lines: the Python SDK chokes on them.

``EventStream`` writes the stream itself rather than through sse-starlette's
``EventSourceResponse``, which runs a task group of four tasks and a cancel scope around every
send for each response: that machinery was a third of the gateway's CPU per streamed request
(``bench/overhead``; ``docs/ARCHITECTURE.md``, "The hot path"). It keeps the same wire: ``\\n``
separators, ``: ping`` heartbeats, the same headers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Protocol

import orjson
from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

from core.errors import TandemError
from gateway.serving.hangup import (
    ClientGone,
    HangUpCancels,
    client_gone_of,
    unless_client_leaves,
)

log = logging.getLogger("tandem.requests")

HEARTBEAT = b": ping\n\n"
"""An SSE comment: clients and proxies see bytes, the SDKs skip it."""

_HEADERS = {
    "Cache-Control": "no-cache",
    "Connection": "keep-alive",
    "X-Accel-Buffering": "no",  # nginx would otherwise buffer the stream
}


class StreamSource(Protocol):
    """What ``serve_stream`` needs from a request: open it, relay it, let it go."""

    headers: dict[str, str]

    async def open_stream(self) -> None: ...

    async def quota_answered(self) -> None:
        """Returns once ``headers`` hold the quota's answer (or admission ended otherwise)."""
        ...

    def events(self) -> AsyncIterator[bytes]:
        """Each event's payload: one line of JSON, or ``[DONE]``."""
        ...

    async def aclose(self) -> None: ...


def frame(payload: bytes) -> bytes:
    """One SSE event carrying ``payload``. A payload with line breaks (never orjson's JSON)
    becomes one ``data:`` line per line, as the SSE spec frames it."""
    if b"\n" in payload or b"\r" in payload:
        lines = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        return b"".join([b"data: " + line + b"\n" for line in lines]) + b"\n"
    return b"data: " + payload + b"\n\n"


class EventStream(Response):
    """A ``text/event-stream`` response: each payload of ``events`` as one ``data:`` event,
    and a heartbeat every ``ping_interval_s`` (0: none) from a timer, not a task.

    The handler's own task writes the events. A hang-up cancels it (``HangUpCancels``: the
    server's signal, or a watcher task per response), which ends ``events`` where it is
    suspended (the request is aborted, as a client that leaves must see). ``on_close`` is
    awaited however the response ends, even if the client left before the first event (then
    ``events`` never ran, so its own cleanup could not). ``heartbeat_first`` sends one
    heartbeat with the headers: a stream committed before its first token says at once that
    it is alive.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: Mapping[str, str],
        ping_interval_s: float,
        on_close: Callable[[], Awaitable[None]],
        *,
        heartbeat_first: bool = False,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({**_HEADERS, **headers})
        self._events = events
        self._ping_interval_s = ping_interval_s
        self._on_close = on_close
        self._heartbeat_first = heartbeat_first
        self._streaming = False
        self._send: Send | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._pinging: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        self._streaming = True
        watch = HangUpCancels(client_gone_of(scope, receive))
        try:
            with watch:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                self.raw_headers = []  # sent: not held for the stream's life (about 1.3 KiB)
                _let_go_of_request_headers(scope)
                if self._heartbeat_first:
                    await send(_body(HEARTBEAT))
                self._arm_heartbeat()
                async for payload in self._events:
                    event = frame(payload)
                    # Not held while the next event is awaited: orjson's bytes keep their
                    # whole working buffer (core/jsonbytes.py), the framed copy only itself.
                    del payload
                    await send(_body(event))
            await self._stop_streaming()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            # The client left (the watch cancelled us): the response is over, not failed.
            # Any other cancellation (the server stopping) goes on up.
            if not watch.absorb_hang_up():
                raise
        finally:
            await self._stop_streaming()
            try:
                await _aclose(self._events)
            finally:
                await self._on_close()

    def _arm_heartbeat(self) -> None:
        if self._ping_interval_s > 0 and self._streaming:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self._ping_interval_s, self._heartbeat_due)

    def _heartbeat_due(self) -> None:
        if self._streaming:
            self._pinging = asyncio.ensure_future(self._heartbeat())

    async def _heartbeat(self) -> None:
        assert self._send is not None
        try:
            await self._send(_body(HEARTBEAT))
        except OSError as exc:  # the events' next send meets the same failure and ends it
            log.debug("heartbeat not sent: %r", exc)
            return
        self._arm_heartbeat()

    async def _stop_streaming(self) -> None:
        """No heartbeat after this: the last message of a response must be the last sent."""
        self._streaming = False
        if self._timer is not None:
            self._timer.cancel()
        pinging, self._pinging = self._pinging, None
        if pinging is not None and not pinging.done():
            pinging.cancel()
            await asyncio.wait((pinging,))


def _let_go_of_request_headers(scope: Scope) -> None:
    """The request's headers, emptied where they are (the scope's list, which starlette's
    ``Request.headers`` reads too): its route read them before the response started, and
    nothing reads them after. An OpenAI SDK's request carries 17 (nine ``x-stainless-*``),
    2.7 KiB held for the stream's whole life otherwise. The gateway's own server keeps no
    other reference (``gateway/cli/http_protocol.py``)."""
    headers = scope.get("headers")
    if isinstance(headers, list):
        headers.clear()


def _body(chunk: bytes) -> Message:
    return {"type": "http.response.body", "body": chunk, "more_body": True}


async def _aclose(events: AsyncIterator[bytes]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


async def serve_stream(
    source: StreamSource, ping_interval_s: float, client_gone: ClientGone
) -> Response:
    """The streaming response for ``source``: committed at once if it opens within one
    heartbeat interval (errors then raise, as HTTP statuses), else committed with a ping.

    A client that hangs up before then ends the request at once (``ClientDisconnectedError``):
    the engine's work on its first token is aborted, not left running until the stream would
    have committed (a heartbeat interval, or a long prompt's prefill)."""
    opening = asyncio.ensure_future(source.open_stream())
    try:
        await unless_client_leaves(
            _committable(opening, source, ping_interval_s),
            client_gone,
            "The client closed the connection before the first token.",
        )
    except BaseException:
        await _cancel(opening)
        await source.aclose()
        raise
    if opening.done():
        try:
            opening.result()
        except BaseException:
            await source.aclose()
            raise
        return EventStream(source.events(), source.headers, ping_interval_s, source.aclose)

    async def close() -> None:
        # However the response ends (even before its events started), the request stops
        # waiting (leaves the queue, aborts its leg) before it is let go.
        await _cancel(opening)
        await source.aclose()

    return EventStream(
        _after_opening(opening, source),
        source.headers,
        ping_interval_s,
        close,
        heartbeat_first=True,
    )


async def _committable(
    opening: asyncio.Future[None], source: StreamSource, ping_interval_s: float
) -> None:
    """Returns once the stream may commit: opened, or one heartbeat interval passed and the
    quota store answered (``opening`` goes on)."""
    await asyncio.wait((opening,), timeout=ping_interval_s or None)
    if not opening.done():  # only slow requests pay for the second wait
        answered = asyncio.ensure_future(source.quota_answered())
        try:
            await asyncio.wait((opening, answered), return_when=asyncio.FIRST_COMPLETED)
        finally:
            await _cancel(answered)


async def _after_opening(
    opening: asyncio.Future[None], source: StreamSource
) -> AsyncIterator[bytes]:
    """A committed stream whose request is still queued or prefilling: the events once it
    opens, or the error as one event. A client that leaves cancels the wait; the response's
    close then cancels ``opening`` itself."""
    try:
        await asyncio.shield(opening)
    except TandemError as exc:
        log.info("stream failed before its first token: %s (%s)", exc.message, exc.code)
        yield orjson.dumps(exc.to_body())
        return
    async for payload in source.events():
        yield payload


async def _cancel(task: asyncio.Future[None]) -> None:
    task.cancel()
    await asyncio.wait((task,))
