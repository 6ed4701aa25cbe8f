"""What a running request yields to whoever answers its client, and the head of that answer.

A stream's run (``RequestFlow.run``) yields ``OPENED`` once its first token is ready (errors
before it are HTTP statuses), then the client's chunks, then one ``StreamEnd``: ``[DONE]`` or the
error event. A non-streaming run yields its one answer. ``LiveStream`` hands a run to the SSE
response (``gateway/serving/sse.py``); ``IdempotentRuns`` reads one in the background instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

import orjson

from core.errors import TandemError
from core.messages import Endpoint


class Opened:
    """The stream is admitted and its first token is ready: the response may commit."""


OPENED: Final = Opened()


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a committed stream ended: ``[DONE]``, or the error the client gets as one event
    (its headers are gone)."""

    error: TandemError | None = None

    def payload(self) -> bytes:
        return b"[DONE]" if self.error is None else orjson.dumps(self.error.to_body())


Chunk = dict[str, Any]
Item = Opened | Chunk | StreamEnd
Run = AsyncGenerator[Item, None]


@dataclass(slots=True)
class ResponseHead:
    """The answer's headers, growing as the request advances: the request id at once,
    ``x-ratelimit-*`` when the quota is reserved, ``x-tandem-queue-ms`` when admitted."""

    headers: dict[str, str]
    _quota_answered: bool = False
    # Made only for a stream still queued after a heartbeat interval (the one that waits):
    # an asyncio.Event weighs 0.75 KiB, for the whole life of every stream.
    _answered: asyncio.Event | None = None

    def quota_reserved(self, ratelimit_headers: dict[str, str]) -> None:
        self.headers.update(ratelimit_headers)
        self._answer()

    def admission_ended(self, queue_wait_s: float | None) -> None:
        """Admitted (with its queue wait) or refused (None): the quota has answered."""
        if queue_wait_s is not None:
            self.headers["x-tandem-queue-ms"] = str(round(queue_wait_s * 1000))
        self._answer()

    async def quota_answered(self) -> None:
        """Returns once the quota store has answered (the rate-limit headers are set) or
        admission ended otherwise."""
        if self._quota_answered:
            return
        if self._answered is None:
            self._answered = asyncio.Event()
        await self._answered.wait()

    def _answer(self) -> None:
        self._quota_answered = True
        if self._answered is not None:
            self._answered.set()

    @contextmanager
    def on_errors(self) -> Iterator[None]:
        """An error before the first byte carries the request id and rate-limit headers."""
        try:
            yield
        except TandemError as exc:
            exc.extra_headers = {**self.headers, **exc.extra_headers}
            raise


class LiveStream:
    """A streaming run as ``serve_stream`` reads it (``gateway/serving/sse.py``)."""

    def __init__(self, run: Run, head: ResponseHead) -> None:
        self._run = run
        self._head = head
        self.headers = head.headers

    async def open_stream(self) -> None:
        first = await anext(self._run)
        if first is not OPENED:
            raise RuntimeError(f"a stream's run yielded {first!r} before OPENED")

    async def quota_answered(self) -> None:
        await self._head.quota_answered()

    async def events(self) -> AsyncIterator[bytes]:
        async for item in self._run:
            yield item.payload() if isinstance(item, StreamEnd) else orjson.dumps(item)

    async def aclose(self) -> None:
        await self._run.aclose()


async def answer_of(run: Run) -> Chunk:
    """A non-streaming run's answer (the run settles and bills before it yields it)."""
    try:
        answer = await anext(run)
        if not isinstance(answer, dict):
            raise RuntimeError(f"a non-streaming run yielded {answer!r}")
        return answer
    finally:
        await run.aclose()


def content_key(endpoint: Endpoint) -> str:
    """Where a chunk's choice carries its content: ``delta`` (chat) or ``text``."""
    return "delta" if endpoint is Endpoint.CHAT else "text"


def choice_text(choice: dict[str, Any], endpoint: Endpoint, *, streamed: bool) -> str | None:
    """A choice's text: a chunk's ``delta.content`` (``streamed``) or an answer's
    ``message.content`` for chat, ``text`` for completions; None when it carries none."""
    if endpoint is Endpoint.CHAT:
        holder = choice.get("delta" if streamed else "message")
        text = holder.get("content") if isinstance(holder, dict) else None
    else:
        text = choice.get("text")
    return text if isinstance(text, str) else None
