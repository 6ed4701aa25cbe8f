"""Relaying one decode worker's stream to the client, chunk by chunk.

Each vLLM chunk is parsed, given the gateway's response id and ``created``, stripped of what the
client did not ask for (the usage chunk, ``usage`` fields, internal ``kv_transfer_params``),
passed through output moderation, and handed on as a dict (the caller serialises it). The
relay counts output on the request and keeps the finish reason and the engine's usage for the
flow to end the request with; it settles, bills and ends nothing itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson

from core.errors import EngineError
from core.messages import Usage
from core.request import Request, RequestPhase
from gateway.serving.events import content_key
from gateway.serving.output_filter import OutputFilter
from gateway.serving.routing import DecodeLeg

log = logging.getLogger("tandem.requests")


class Relay:
    """One decode stream as the client's chunks. It holds the decode worker's slot from its
    creation until ``close()``, which the flow calls however the request ends."""

    def __init__(
        self,
        leg: DecodeLeg,
        request: Request,
        output_filter: OutputFilter | None,
        charge_output: Callable[[int], None],
    ) -> None:
        """``charge_output`` is told each batch of output tokens (the fair queue's charge)."""
        if leg.stream is None:
            raise ValueError("Relay needs a streaming decode leg")
        self._upstream = leg.stream
        self._worker_name = leg.worker.name
        self._request = request
        self._output_filter = output_filter
        self._charge_output = charge_output
        self._response_id = request.response_id
        self._model = request.model.version_name
        self._content_key = content_key(request.endpoint)
        self._prompt_tokens: int | None = None
        self._choice_tokens: dict[int, int] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        """The engine's final usage chunk, when it sent one."""
        self._lease = leg.worker.lease().hold()  # across calls: released by close()

    def close(self) -> None:
        """Drop the upstream connection (vLLM aborts the request) and give the slot back;
        idempotent."""
        self._upstream.close()
        self._lease.release()

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        """The client's chunks, until the engine's stream ends (or every choice was cut)."""
        request = self._request
        include_usage = request.include_usage
        request.advance(RequestPhase.DECODING)
        request.let_go_of_prompt()
        request.follow_usage(self.usage_so_far)
        async for payload in self._upstream.events(request.deadline):
            chunk = self._parse(payload)
            choices = chunk.get("choices")
            if not choices:
                # vLLM's usage chunk (``choices: []``): always recorded, relayed only if asked.
                if chunk.get("usage"):
                    self.usage = Usage.from_openai(chunk["usage"])
                    if include_usage:
                        yield chunk
                continue
            if chunk.get("usage"):
                self._running_usage(chunk["usage"], choices)
            self._count_output(choices)
            if include_usage:
                chunk["usage"] = None
            else:
                chunk.pop("usage", None)
            output_filter = self._output_filter
            if output_filter is not None:
                filtered = await output_filter.filter_chunk(chunk)
                if filtered is None:
                    continue  # held back until the moderation window has seen it
                chunk = filtered
            for choice in chunk["choices"]:
                self.finish_reason = choice.get("finish_reason") or self.finish_reason
            request.mark_first_token()
            for part in split_finish_chunk(chunk, self._content_key):
                yield part
            if output_filter is not None and output_filter.all_blocked:
                # Every choice was cut: stop the engine now, bill what it produced.
                self._upstream.close()
                usage = self.usage_so_far()
                if include_usage and usage is not None:
                    yield _usage_chunk(chunk, usage)
                return

    def _count_output(self, choices: list[dict[str, Any]]) -> None:
        """Output tokens as the engine sends them (about one per content delta): the fair
        queue charges them, and a stream cut without the engine's usage is billed by them."""
        num_tokens = 0
        for choice in choices:  # a loop, not sum() over a generator: this runs per chunk
            if _has_content(choice, self._content_key):
                num_tokens += 1
        if num_tokens:
            self._request.count_output(num_tokens)
            self._charge_output(num_tokens)

    def _running_usage(self, usage: dict[str, Any], choices: list[dict[str, Any]]) -> None:
        """vLLM's ``continuous_usage_stats``: each chunk carries its choice's output so far.
        Kept as plain counts, read by ``usage_so_far`` (a ``Usage`` per chunk was a twentieth
        of the gateway's CPU per chunk)."""
        completion_tokens = int(usage.get("completion_tokens") or 0)
        for choice in choices:
            self._choice_tokens[int(choice.get("index", 0))] = completion_tokens
        self._prompt_tokens = int(usage.get("prompt_tokens") or 0)

    def usage_so_far(self) -> Usage | None:
        """The engine's count so far (its running usage), None before its first count."""
        if self._prompt_tokens is None:
            return None
        return Usage(self._prompt_tokens, sum(self._choice_tokens.values()))

    def _parse(self, payload: bytes) -> dict[str, Any]:
        name = self._worker_name
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise EngineError(f"decode worker {name} sent an invalid event") from exc
        if not isinstance(chunk, dict):
            raise EngineError(f"decode worker {name} sent an event that is not an object")
        if "error" in chunk:
            raise EngineError(f"decode worker {name} failed mid-stream: {chunk['error']}")
        chunk["id"] = self._response_id
        chunk["created"] = self._request.created
        chunk["model"] = self._model  # the version that served it, whatever its workers call it
        chunk.pop("kv_transfer_params", None)
        return chunk


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


def split_finish_chunk(chunk: dict[str, Any], content_key: str) -> list[dict[str, Any]]:
    """vLLM puts the last token and the finish reason in one chunk; OpenAI sends the finish
    reason alone, with an empty delta (or empty text). Clients that stop reading content at the
    finish reason then still get the last token."""
    choices: list[dict[str, Any]] = chunk["choices"]
    if len(choices) == 1 and not choices[0].get("finish_reason"):
        return [chunk]  # most chunks: one choice, still running
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


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def log_request_end(request: Request, trace_id: str | None = None) -> None:
    """One line per finished request: path, workers, latency and tokens, and its trace id
    when it was traced (``-`` otherwise)."""
    usage = request.usage
    log.info(
        "request %s %s trace=%s version=%s (%s) path=%s prefill=%s decode=%s prefill_leg=%s "
        "kv_blocks=%s kv_bytes=%s decode_first_token=%s ttft=%.3fs e2e=%.3fs tokens=%s/%s "
        "finish=%s",
        request.request_id,
        request.phase.name.lower(),
        trace_id or "-",
        request.model.version_name,
        request.resolved_by,
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
