"""Data-only SSE for the OpenAI SDKs, started early enough that no client or proxy times out.

A stream's HTTP status and headers are decided by when it commits. Its response waits up
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

from core.errors import ClientDisconnectedError, TandemError
from gateway.errors import handled_response
from gateway.serving.hangup import HangUpCancels, client_gone_of

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

    async def open_stream(self) -> None:
        """Returns once the stream may start (admitted, its first token ready), or raises the
        error its client gets. It watches for its client leaving meanwhile: a hang-up raises
        ``ClientDisconnectedError`` and aborts what the request was waiting for."""
        ...

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
    ``events`` never ran, so its own cleanup could not). Built by ``serve_stream``, it first
    opens its source in the same task and commits as that module's docstring says.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes] | None,
        headers: Mapping[str, str],
        ping_interval_s: float,
        on_close: Callable[[], Awaitable[None]],
        *,
        source: StreamSource | None = None,
    ) -> None:
        """``events`` is None with a ``source``: its events once it opened. ``headers`` are
        read when the response commits (a source's grow while it opens)."""
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self._committed_headers = headers
        self._events = events
        self._source = source
        self._ping_interval_s = ping_interval_s
        self._on_close = on_close
        self._started = False
        self._streaming = False
        self._send: Send | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._pinging: asyncio.Task[None] | None = None
        self._committing: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        try:
            if self._source is not None:
                try:
                    await self._open(self._source, scope)
                    self._events = self._source.events()
                except Exception as exc:
                    if not self._started:  # nothing sent: the error is the response's status
                        if (handled := await handled_response(exc, scope, receive)) is None:
                            raise
                        await handled(scope, receive, send)
                        return
                    if isinstance(exc, ClientDisconnectedError):
                        return  # nobody is left to read an error event
                    if not isinstance(exc, TandemError):
                        raise
                    # Committed early: the error is the stream's one event.
                    log.info("stream failed before its first token: %s (%s)", exc.message,
                             exc.code)  # fmt: skip
                    self._events = _one(orjson.dumps(exc.to_body()))
            await self._stream(scope, receive)
        finally:
            await self._stop_streaming()
            try:
                if self._events is not None:
                    await _aclose(self._events)
            finally:
                await self._on_close()

    async def _open(self, source: StreamSource, scope: Scope) -> None:
        """Wait for ``source`` to open, in this task. Past one heartbeat interval a task
        commits the response (once the quota answered) with a heartbeat, and heartbeats go on
        while the source opens. The source itself hears its client leave meanwhile
        (``ClientDisconnectedError``)."""
        timer = None
        if self._ping_interval_s > 0:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(self._ping_interval_s, self._commit_early, source, scope)
        try:
            await source.open_stream()
        finally:
            await self._stop_early_commit(timer)

    def _commit_early(self, source: StreamSource, scope: Scope) -> None:
        self._committing = asyncio.ensure_future(self._commit_once_answered(source, scope))

    async def _commit_once_answered(self, source: StreamSource, scope: Scope) -> None:
        await source.quota_answered()
        try:
            await self._start(scope, heartbeat=True)
        except OSError as exc:  # the client left: the source's own watch ends its opening
            log.debug("stream not committed: %r", exc)
            return
        self._arm_heartbeat()

    async def _stop_early_commit(self, timer: asyncio.TimerHandle | None) -> None:
        """No early commit from here on; one that already started the response stands."""
        if timer is not None:
            timer.cancel()
        committing, self._committing = self._committing, None
        if committing is not None and not committing.done():
            committing.cancel()
            await asyncio.wait((committing,))

    async def _stream(self, scope: Scope, receive: Receive) -> None:
        """The events, under the client's watch; committed first if the open did not."""
        assert self._events is not None
        watch = HangUpCancels(client_gone_of(scope, receive))
        try:
            with watch:
                if not self._started:
                    await self._start(scope, heartbeat=False)
                if self._timer is None:
                    self._arm_heartbeat()
                send = self._send
                assert send is not None
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

    async def _start(self, scope: Scope, *, heartbeat: bool) -> None:
        """Commit: status 200 and the headers as they are now, with a heartbeat when the
        first event is not ready."""
        assert self._send is not None
        self._started = self._streaming = True
        self.init_headers({**_HEADERS, **self._committed_headers})
        await self._send(
            {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
        )
        self.raw_headers = []  # sent: not held for the stream's life (about 1.3 KiB)
        _let_go_of_request_headers(scope)
        if heartbeat:
            await self._send(_body(HEARTBEAT))

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


def serve_stream(source: StreamSource, ping_interval_s: float) -> EventStream:
    """The streaming response for ``source``. It opens the source in the handler's own task
    (a task of its own was a hop through the event loop each way, before the first token):
    committed at once if it opens within one heartbeat interval (errors then answer as HTTP
    statuses, by the app's handlers), else committed with a ping once the quota answered.

    A client that hangs up before then ends the request at once: the source's own watch
    (``ClientDisconnectedError``) aborts the engine's work on its first token, not left
    running until the stream would have committed (a heartbeat interval, or a long prompt's
    prefill)."""
    return EventStream(None, source.headers, ping_interval_s, source.aclose, source=source)


async def _one(payload: bytes) -> AsyncIterator[bytes]:
    yield payload
