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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import orjson
from fastapi.responses import Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from core.errors import TandemError

log = logging.getLogger("tandem.requests")

PING = ServerSentEvent(comment="ping", sep="\n")  # sse-starlette's default separator is \r\n


class StreamSource(Protocol):
    """What ``serve_stream`` needs from a request: open it, relay it, let it go."""

    headers: dict[str, str]

    async def open_stream(self) -> None: ...

    async def quota_answered(self) -> None:
        """Returns once ``headers`` hold the quota's answer (or admission ended otherwise)."""
        ...

    def events(self) -> AsyncIterator[str]: ...

    async def aclose(self) -> None: ...


class OpenAIEventStream(EventSourceResponse):
    """``\\n`` separators and ``: ping`` heartbeats (``ping_interval_s`` 0 turns them off).

    ``on_close`` is awaited however the response ends, even if the client left before the
    first event (then the body generator never runs, so its own cleanup could not)."""

    def __init__(
        self,
        events: AsyncIterator[str | ServerSentEvent],
        headers: dict[str, str],
        ping_interval_s: float,
        on_close: Callable[[], Awaitable[None]],
    ) -> None:
        super().__init__(
            events,
            sep="\n",
            ping=ping_interval_s,
            ping_message_factory=lambda: PING,
            headers={"Cache-Control": "no-cache", **headers},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def serve_stream(source: StreamSource, ping_interval_s: float) -> Response:
    """The streaming response for ``source``: committed at once if it opens within one
    heartbeat interval (errors then raise, as HTTP statuses), else committed with a ping."""
    opening = asyncio.ensure_future(source.open_stream())
    try:
        await asyncio.wait((opening,), timeout=ping_interval_s or None)
        if not opening.done():  # only slow requests pay for the second wait
            answered = asyncio.ensure_future(source.quota_answered())
            try:
                await asyncio.wait((opening, answered), return_when=asyncio.FIRST_COMPLETED)
            finally:
                await _cancel(answered)
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
        return OpenAIEventStream(source.events(), source.headers, ping_interval_s, source.aclose)
    return OpenAIEventStream(
        _after_opening(opening, source), source.headers, ping_interval_s, source.aclose
    )


async def _after_opening(
    opening: asyncio.Future[None], source: StreamSource
) -> AsyncIterator[str | ServerSentEvent]:
    """A committed stream whose request is still queued or prefilling: a heartbeat now (the
    periodic ones follow), then the events, or the error as one event."""
    yield PING
    try:
        await asyncio.shield(opening)
    except TandemError as exc:
        log.info("stream failed before its first token: %s (%s)", exc.message, exc.code)
        yield orjson.dumps(exc.to_body()).decode()
        return
    except asyncio.CancelledError:
        await _cancel(opening)  # the client left: leave the queue or abort the leg now
        raise
    async for payload in source.events():
        yield payload


async def _cancel(task: asyncio.Future[None]) -> None:
    task.cancel()
    await asyncio.wait((task,))
