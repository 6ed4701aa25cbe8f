"""Relaying one decode worker's stream to the client, chunk by chunk.

Each vLLM chunk is parsed, given the gateway's response id and ``created``, stripped of what the
client did not ask for (the usage chunk, ``usage`` fields, internal ``kv_transfer_params``) and
re-serialised. The engine's usage and the finish reason are recorded on the ``Request``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import orjson

from core.errors import EngineError, TandemError
from core.messages import Endpoint, Usage
from core.request import Request, RequestPhase
from gateway.output_filter import OutputFilter
from gateway.upstream import EngineStream
from workers.registry import Worker

log = logging.getLogger("tandem.requests")


@dataclass(frozen=True, slots=True)
class RelayHooks:
    """What the caller wants to hear from, or do to, a relayed stream."""

    on_output: Callable[[int], None] | None = None
    """Told each batch of output tokens as it arrives (the fair queue's output charge)."""
    before_last_event: Callable[[], Awaitable[None]] | None = None
    """Awaited once the request ended, before its last event (quota settlement)."""
    output_filter: OutputFilter | None = None
    """Output moderation: rewrites or holds back chunks, cuts blocked choices."""
    on_chunk: Callable[[dict[str, Any]], None] | None = None
    """Sees every chunk exactly as the client gets it (idempotent requests store them)."""


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
        hooks: RelayHooks,
    ) -> None:
        self._upstream = upstream
        self._response_id = response_id(endpoint, request)
        self._content_key = "delta" if endpoint is Endpoint.CHAT else "text"
        self._worker = worker
        self._request = request
        self._include_usage = include_usage
        self._on_end = on_end
        self._hooks = hooks
        self._closed = False
        self.error: TandemError | None = None
        """The error that ended the stream after its first byte, if one did."""
        self._choice_tokens: dict[int, int] = {}
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
            async for payload in self._upstream.events(request.deadline):
                chunk = self._parse(payload)
                choices = chunk.get("choices")
                if not choices:
                    # vLLM's usage chunk (``choices: []``): always recorded, relayed only if asked.
                    if chunk.get("usage"):
                        usage = Usage.from_openai(chunk["usage"])
                        if self._include_usage:
                            yield self._emit(chunk)
                    continue
                if chunk.get("usage"):
                    self._running_usage(chunk["usage"], choices)
                self._count_output(choices)
                if self._include_usage:
                    chunk["usage"] = None
                else:
                    chunk.pop("usage", None)
                output_filter = self._hooks.output_filter
                if output_filter is not None:
                    filtered = await output_filter.filter_chunk(chunk)
                    if filtered is None:
                        continue  # held back until the moderation window has seen it
                    chunk = filtered
                for choice in chunk["choices"]:
                    finish_reason = choice.get("finish_reason") or finish_reason
                request.mark_first_token()
                for part in split_finish_chunk(chunk, self._content_key):
                    yield self._emit(part)
                if output_filter is not None and output_filter.all_blocked:
                    # Every choice was cut: stop the engine now, bill what it produced.
                    self._upstream.close()
                    if self._include_usage and request.usage is not None:
                        yield self._emit(self._usage_chunk(chunk, request.usage))
                    break
        except TandemError as exc:
            # Headers are gone: the error becomes one event and the stream ends (docs/WIRE.md §1).
            self.error = exc
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

    def _count_output(self, choices: list[dict[str, Any]]) -> None:
        """Output tokens as the engine sends them (about one per content delta): the fair
        queue charges them, and a stream cut without the engine's usage is billed by them."""
        num_tokens = sum(_has_content(choice, self._content_key) for choice in choices)
        if num_tokens:
            self._request.num_streamed_tokens += num_tokens
            if self._hooks.on_output is not None:
                self._hooks.on_output(num_tokens)

    def _emit(self, chunk: dict[str, Any]) -> str:
        if self._hooks.on_chunk is not None:
            self._hooks.on_chunk(chunk)
        return orjson.dumps(chunk).decode()

    @staticmethod
    def _usage_chunk(last: dict[str, Any], usage: Usage) -> dict[str, Any]:
        """The usage chunk vLLM would have sent, for a stream the gateway ended itself."""
        return {
            "id": last["id"],
            "object": last.get("object"),
            "created": last["created"],
            "model": last.get("model"),
            "choices": [],
            "usage": usage.to_openai(),
        }

    def _running_usage(self, usage: dict[str, Any], choices: list[dict[str, Any]]) -> None:
        """vLLM's ``continuous_usage_stats``: each chunk carries its choice's output so far.
        Kept on the request, so a stream cut short is billed what the engine produced."""
        for choice in choices:
            self._choice_tokens[int(choice.get("index", 0))] = int(
                usage.get("completion_tokens") or 0
            )
        self._request.usage = Usage(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=sum(self._choice_tokens.values()),
        )

    async def _settle(self) -> None:
        # Before the last event: a client that sends its next request on reading [DONE]
        # must find this one's quota settled and its concurrency slot free.
        if self._hooks.before_last_event is not None:
            await self._hooks.before_last_event()

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


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def log_request_end(request: Request) -> None:
    """One line per finished request: path, workers, latency and tokens."""
    usage = request.usage
    log.info(
        "request %s %s path=%s prefill=%s decode=%s prefill_leg=%s kv_blocks=%s kv_bytes=%s "
        "decode_first_token=%s ttft=%.3fs e2e=%.3fs tokens=%s/%s finish=%s",
        request.request_id,
        request.phase.name.lower(),
        request.path,
        request.prefill_worker,
        request.decode_worker,
        _seconds(request.prefill_leg_s),
        request.kv_blocks,
        request.kv_bytes,
        _seconds(request.decode_first_token_s),
        request.ttft_s or 0.0,
        request.e2e_s or 0.0,
        usage.prompt_tokens if usage else "?",
        usage.completion_tokens if usage else "?",
        request.finish_reason,
    )
