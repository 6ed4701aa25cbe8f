"""Relaying one decode worker's stream to the client, chunk by chunk.

Each vLLM chunk is parsed, given the gateway's response id and ``created``, stripped of what the
client did not ask for (the usage chunk, ``usage`` fields, internal ``kv_transfer_params``) and
re-serialised. The engine's usage and the finish reason are recorded on the ``Request``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from core.errors import EngineError, TandemError
from core.messages import Usage
from core.request import Request, RequestPhase
from gateway.upstream import EngineStream
from workers.registry import Worker

log = logging.getLogger("tandem.requests")


class RelayStream:
    """An accepted streaming request: ``events()`` yields SSE data payloads, ``aclose()`` cleans up.

    ``aclose()`` is idempotent and must run however the response ends (finished, failed, client
    gone, or never started): it drops the upstream connection (vLLM aborts the request), gives
    the worker's slot back and ends the request as aborted if nothing else ended it.
    """

    def __init__(
        self,
        upstream: EngineStream,
        worker: Worker,
        request: Request,
        response_id: str,
        include_usage: bool,
    ) -> None:
        self._upstream = upstream
        self._worker = worker
        self._request = request
        self._response_id = response_id
        self._include_usage = include_usage
        self._closed = False
        worker.num_outstanding += 1

    async def events(self) -> AsyncIterator[str]:
        """The client's payloads: chunks, then ``[DONE]``; or chunks, then one error event."""
        request = self._request
        finish_reason: str | None = None
        usage: Usage | None = None
        request.advance(RequestPhase.DECODING)
        try:
            async for payload in self._upstream.events():
                chunk = self._parse(payload)
                choices = chunk.get("choices")
                if not choices:
                    # vLLM's usage chunk (``choices: []``): always recorded, relayed only if asked.
                    if chunk.get("usage"):
                        usage = Usage.from_openai(chunk["usage"])
                        if self._include_usage:
                            yield orjson.dumps(chunk).decode()
                    continue
                for choice in choices:
                    finish_reason = choice.get("finish_reason") or finish_reason
                if self._include_usage:
                    chunk["usage"] = None
                else:
                    chunk.pop("usage", None)
                request.mark_first_token()
                yield orjson.dumps(chunk).decode()
        except TandemError as exc:
            # Headers are gone: the error becomes one event and the stream ends (WIRE.md §1).
            request.fail(exc.code)
            log.warning("request %s failed mid-stream: %s", request.request_id, exc.message)
            yield orjson.dumps(exc.to_body()).decode()
            return
        request.finish(finish_reason, usage)
        yield "[DONE]"

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._upstream.close()
        self._worker.num_outstanding -= 1
        if not self._request.phase.is_terminal:
            self._request.abort()
            log.info("request %s aborted: the client went away", self._request.request_id)

    def _parse(self, payload: bytes) -> dict[str, Any]:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"decode worker {self._worker.name} sent an invalid event") from exc
        name = self._worker.name
        if not isinstance(chunk, dict):
            raise EngineError(f"decode worker {name} sent an event that is not an object")
        if "error" in chunk:
            raise EngineError(f"decode worker {name} failed mid-stream: {chunk['error']}")
        chunk["id"] = self._response_id
        chunk["created"] = self._request.created
        chunk.pop("kv_transfer_params", None)
        return chunk
