"""``Idempotency-Key`` (docs/WIRE.md §3): a retried request runs once; its retry gets the answer.

    claim(tenant + route + key, fingerprint of the body)
      Replay     -> the stored answer (JSON, or re-chunked SSE), ``Idempotent-Replayed: true``,
                    not charged
      InProgress -> 409 with ``retry-after``;  Mismatch -> 422
      Claimed    -> run it; store the answer (or the engine's error) for the retention period;
                    a request rejected before any engine saw it frees the key instead

An idempotent stream runs in a background task owned by ``IdempotentRuns``: if its client
leaves, generation goes on to the end and is stored, so the retry gets the whole answer once.
The claim's lease outlives the request's deadline, so it only lapses if this gateway dies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi.responses import Response

from admission.idempotency import (
    Claimed,
    IdempotencyStore,
    InProgress,
    Mismatch,
    Replay,
    StoredResponse,
    scope_key,
)
from core.errors import (
    IdempotencyInProgressError,
    IdempotencyMismatchError,
    StoreUnavailableError,
    TandemError,
)
from core.jsonbytes import dumps_to_keep
from core.messages import Endpoint
from core.request import Request
from gateway.serving.events import ResponseHead, Run, StreamEnd, answer_of
from gateway.serving.hangup import ClientGone, unless_client_leaves
from gateway.serving.replay import StreamAssembler, rechunk
from gateway.serving.sse import EventStream

log = logging.getLogger("tandem.requests")

REPLAYED_HEADER = "Idempotent-Replayed"
_END = object()  # end of a live stream's queue


@dataclass(frozen=True, slots=True)
class IdempotencyConfig:
    """How long answers are kept and how long a running claim may outlive its deadline."""

    retention_s: float = 24 * 3600.0
    """A completed key replays its answer for this long."""
    lease_margin_s: float = 60.0
    """A claim lasts the request's deadline plus this; past it, a dead gateway's key frees."""


@dataclass(frozen=True, slots=True)
class IdempotentKey:
    """A claimed key: its scope and the token that proves the claim is ours."""

    scope: str
    token: str


class IdempotentRuns:
    """Claims keys, runs idempotent requests to the end, stores and replays their answers."""

    def __init__(self, store: IdempotencyStore, config: IdempotencyConfig) -> None:
        self._store = store
        self._config = config
        self._tasks: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        """Shutdown: runs still going are cancelled (their engine requests aborted) and their
        keys freed, so a retry runs them again rather than finding nothing."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    async def claim(
        self, tenant_id: str, endpoint: Endpoint, key: str, fingerprint: str, request: Request
    ) -> IdempotentKey | StoredResponse:
        """Our claim on the key, or the stored answer to replay; 409/422 otherwise."""
        scope = scope_key(tenant_id, endpoint.value, key)
        remaining = request.remaining_s() or 0.0
        outcome = await self._store.claim(
            scope, fingerprint, max(remaining, 0.0) + self._config.lease_margin_s
        )
        if isinstance(outcome, Claimed):
            return IdempotentKey(scope, outcome.token)
        if isinstance(outcome, Replay):
            return outcome.response
        if isinstance(outcome, InProgress):
            raise IdempotencyInProgressError(
                "A request with this Idempotency-Key is still running; retry once it ended.",
                retry_after_s=outcome.retry_after_s,
            )
        assert isinstance(outcome, Mismatch)  # the ClaimResult union is closed
        raise IdempotencyMismatchError(
            "This Idempotency-Key was already used with a different request body; use a new "
            "key for a different request.",
            param="Idempotency-Key",
        )

    async def complete(self, key: IdempotentKey, request: Request, run: Run) -> dict[str, Any]:
        """Run a non-streaming request to the end (its client leaving does not stop it) and
        store the answer."""
        try:
            answer = await answer_of(run)
        except TandemError as exc:
            await self._settle_key(key, request, exc.status_code, exc.to_body())
            raise
        except BaseException:
            await self._store.release(key.scope, key.token)
            raise
        await self._settle_key(key, request, 200, answer)
        return answer

    async def release(self, key: IdempotentKey) -> None:
        """Free a key whose request was refused before it ran."""
        await self._store.release(key.scope, key.token)

    def stream(
        self,
        key: IdempotentKey,
        request: Request,
        run: Run,
        head: ResponseHead,
        client_gone: ClientGone,
    ) -> TeeSource:
        """Start a streaming request in the background; the response reads it live, until
        ``client_gone``."""
        tee = TeeSource(head, StreamAssembler(request.endpoint), client_gone)
        task = asyncio.create_task(self._run_stream(key, request, run, tee))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return tee

    async def _run_stream(
        self, key: IdempotentKey, request: Request, run: Run, tee: TeeSource
    ) -> None:
        # The key is settled before the client hears how its request ended (the error status,
        # or the last event: [DONE] or the error event), so a client that retries at once
        # finds the answer stored or the key free, never a 409 for a request that is over.
        last: bytes | None = None
        try:
            try:
                await anext(run)  # OPENED
            except TandemError as exc:
                try:
                    await self._settle_key(key, request, exc.status_code, exc.to_body())
                finally:
                    tee.opened.set_exception(exc)
                return
            tee.opened.set_result(None)
            async for item in run:
                if last is not None:
                    tee.put(last)
                if isinstance(item, StreamEnd):
                    last = item.payload()
                    await self._settle_end(key, request, item, tee.assembler)
                    continue
                assert isinstance(item, dict)
                tee.assembler.add(item)
                last = dumps_to_keep(item)  # waits for the next item
        except BaseException as exc:
            if not tee.opened.done():
                if isinstance(exc, asyncio.CancelledError):
                    tee.opened.cancel()
                else:
                    tee.opened.set_exception(exc)
            await asyncio.shield(self._store.release(key.scope, key.token))
            raise
        finally:
            if last is not None:
                tee.put(last)
            tee.put(_END)
            await run.aclose()

    async def _settle_end(
        self, key: IdempotentKey, request: Request, end: StreamEnd, assembler: StreamAssembler
    ) -> None:
        """Store how a stream ended: the error event's error, or the assembled answer with
        the engine's usage (even if the client did not ask for it)."""
        if end.error is not None:
            await self._settle_key(key, request, end.error.status_code, end.error.to_body())
            return
        assembled = assembler.result()
        if request.usage is not None:
            assembled["usage"] = request.usage.to_openai()
        await self._settle_key(key, request, 200, assembled)

    async def _settle_key(
        self, key: IdempotentKey, request: Request, status: int, body: dict[str, Any]
    ) -> None:
        """Store the answer if an engine saw the request; else free the key (docs/WIRE.md §3:
        rejected before execution, nothing stored)."""
        try:
            if not request.engine_ran:
                await self._store.release(key.scope, key.token)
                return
            stored = StoredResponse(status, dumps_to_keep(body), time.time())
            retention_s = self._config.retention_s
            if not await self._store.complete(key.scope, key.token, stored, retention_s):
                log.warning("request %s: its idempotency claim lapsed; answer not stored",
                            request.request_id)  # fmt: skip
        except StoreUnavailableError as exc:
            # The answer (or the error) still reaches the client: a 503 instead would send it
            # into retries that find the key claimed until the lease runs out.
            log.warning("request %s: answer not stored, the key frees when its claim lapses: %s",
                        request.request_id, exc.message)  # fmt: skip


class TeeSource:
    """The live side of a background idempotent stream; leaving it does not stop the run."""

    def __init__(
        self, head: ResponseHead, assembler: StreamAssembler, client_gone: ClientGone
    ) -> None:
        self.headers = head.headers
        self._head = head
        self._client_gone = client_gone
        self.assembler = assembler
        self.opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Read even when the client already left, so a failure is not reported as unread.
        self.opened.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._queue: asyncio.Queue[object] | None = asyncio.Queue()

    def put(self, payload: object) -> None:
        if self._queue is not None:
            self._queue.put_nowait(payload)

    async def open_stream(self) -> None:
        # The client stops waiting, the run goes on.
        await unless_client_leaves(
            asyncio.shield(self.opened),
            self._client_gone,
            "The client closed the connection before the first token.",
        )

    async def quota_answered(self) -> None:
        await self._head.quota_answered()

    async def events(self) -> AsyncIterator[bytes]:
        queue = self._queue
        if queue is None:
            return
        while (payload := await queue.get()) is not _END:
            assert isinstance(payload, bytes)
            yield payload

    async def aclose(self) -> None:
        self._queue = None  # the client left: the run goes on, nothing is queued for it


def replay_response(
    stored: StoredResponse, endpoint: Endpoint, stream: bool, include_usage: bool
) -> Response:
    """The stored answer for a retry: as JSON, or re-chunked SSE when it asks for a stream
    (an error is replayed with its status either way, with ``x-should-retry: false``: every
    retry with this key gets the same error until it expires)."""
    headers = {REPLAYED_HEADER: "true"}
    if stored.status_code != 200:
        headers["x-should-retry"] = "false"
    if not stream or stored.status_code != 200:
        return Response(
            stored.body, status_code=stored.status_code, media_type="application/json",
            headers=headers,
        )  # fmt: skip
    chunks = rechunk(orjson.loads(stored.body), endpoint, include_usage=include_usage)
    return EventStream(_replayed(chunks), headers, 0, _nothing)


async def _replayed(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield orjson.dumps(chunk)
    yield b"[DONE]"


async def _nothing() -> None:
    return None
