"""Relaying one decode worker's stream to the client, chunk by chunk.

Each vLLM chunk is parsed, given the gateway's response id and ``created``, stripped of what the
client did not ask for (the usage chunk, ``usage`` fields, internal ``kv_transfer_params``) and
re-serialised. The engine's usage and the finish reason are recorded on the ``Request``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from typing import Any

import orjson

from core.errors import EngineError, TandemError
from core.messages import Endpoint, Usage
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
        endpoint: Endpoint,
        include_usage: bool,
        on_end: Callable[[Request], None],
        on_output: Callable[[int], None] | None = None,
        before_last_event: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._upstream = upstream
        self._response_id = response_id(endpoint, request)
        self._content_key = "delta" if endpoint is Endpoint.CHAT else "text"
        self._worker = worker
        self._request = request
        self._include_usage = include_usage
        self._on_end = on_end
        self._on_output = on_output
        self._before_last_event = before_last_event
        self._closed = False
        # The worker's slot is held for the stream's whole life, across calls: an ExitStack
        # keeps Worker.lease() the one way slots are counted.
        self._lease = ExitStack()
        self._lease.enter_context(worker.lease())

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
                num_tokens = 0
                for choice in choices:
                    finish_reason = choice.get("finish_reason") or finish_reason
                    num_tokens += _has_content(choice, self._content_key)
                if num_tokens:
                    request.num_streamed_tokens += num_tokens
                    if self._on_output is not None:
                        self._on_output(num_tokens)
                if self._include_usage:
                    chunk["usage"] = None
                else:
                    chunk.pop("usage", None)
                request.mark_first_token()
                for part in split_finish_chunk(chunk, self._content_key):
                    yield orjson.dumps(part).decode()
        except TandemError as exc:
            # Headers are gone: the error becomes one event and the stream ends (WIRE.md §1).
            request.fail(exc.code)
            log.warning("request %s failed mid-stream: %s", request.request_id, exc.message)
            self._on_end(request)
            await self._settle()
            yield orjson.dumps(exc.to_body()).decode()
            return
        request.finish(finish_reason, usage)
        self._on_end(request)
        await self._settle()
        yield "[DONE]"

    async def _settle(self) -> None:
        # Before the last event: a client that sends its next request on reading [DONE]
        # must find this one's quota settled and its concurrency slot free.
        if self._before_last_event is not None:
            await self._before_last_event()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._upstream.close()
        self._lease.close()
        if not self._request.phase.is_terminal:
            self._request.abort()
            log.info("request %s aborted: the client went away", self._request.request_id)
            self._on_end(self._request)

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


def split_finish_chunk(chunk: dict[str, Any], content_key: str) -> list[dict[str, Any]]:
    """vLLM puts the last token and the finish reason in one chunk; OpenAI sends the finish
    reason alone, with an empty delta (or empty text). Clients that stop reading content at the
    finish reason then still get the last token."""
    choices: list[dict[str, Any]] = chunk["choices"]
    finishing = [c for c in choices if c.get("finish_reason") and _has_content(c, content_key)]
    if not finishing:
        return [chunk]
    finishing_ids = {id(c) for c in finishing}
    content_choices = [
        {**c, "finish_reason": None, "stop_reason": None} if id(c) in finishing_ids else c
        for c in choices
    ]
    empty: Any = {} if content_key == "delta" else ""
    finish_choices = [
        {
            "index": c.get("index", 0),
            content_key: empty,
            "logprobs": None,
            "finish_reason": c["finish_reason"],
            "stop_reason": c.get("stop_reason"),
        }
        for c in finishing
    ]
    return [{**chunk, "choices": content_choices}, {**chunk, "choices": finish_choices}]


def _has_content(choice: dict[str, Any], content_key: str) -> bool:
    value = choice.get(content_key)
    if isinstance(value, dict):
        return bool(value.get("content") or value.get("tool_calls") or value.get("reasoning"))
    return bool(value)


def response_id(endpoint: Endpoint, request: Request) -> str:
    """The id clients see: the gateway's request id, the same on every chunk and retry."""
    prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
    return f"{prefix}-{request.request_id}"


def log_request_end(request: Request) -> None:
    """One line per finished request: path, workers, latency and tokens."""
    usage = request.usage
    log.info(
        "request %s %s path=%s prefill=%s decode=%s ttft=%.3fs e2e=%.3fs tokens=%s/%s finish=%s",
        request.request_id,
        request.phase.name.lower(),
        request.path,
        request.prefill_worker,
        request.decode_worker,
        request.ttft_s or 0.0,
        request.e2e_s or 0.0,
        usage.prompt_tokens if usage else "?",
        usage.completion_tokens if usage else "?",
        request.finish_reason,
    )
