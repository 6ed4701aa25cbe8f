"""Idempotent replays: one stored final body, built from a stream and replayed as a stream.

Tandem stores the result of an idempotent request as OpenAI's non-streaming body
(``chat.completion`` or ``text_completion``) whichever way the client asked for it, because a
retry may switch between ``stream: true`` and ``false`` (docs/WIRE.md §3). Two pure functions of
that body, no I/O:

- :class:`StreamAssembler` folds the chunks the gateway sent to a client into that body;
- :func:`rechunk` turns the body back into the chunks a streaming retry receives (docs/WIRE.md §1
  framing, without the SSE ``[DONE]``, which the caller frames).

``StreamAssembler`` fed ``rechunk(body)`` gives ``body`` back for any body in the form
``StreamAssembler.result()`` returns (the tests pin it). Normalisations on the way:

- chat ``content`` is ``None`` when it is empty and the message has ``tool_calls`` (OpenAI's
  non-streaming form), else a string (``""`` for an empty answer); ``rechunk`` streams ``None``
  as no content pieces.
- reasoning text is kept under the key the engine used: vLLM 0.32 streams ``reasoning``, older
  versions and some clients use ``reasoning_content``; both are folded and replayed separately.
- a replayed stream carries each choice's whole ``logprobs`` on its first content chunk (on the
  finish chunk when there is no content): text pieces are cut by characters, not tokens, so
  per-token logprobs cannot follow them piece by piece. Folding them back concatenates the lists,
  so the JSON form is unchanged.
- fields only the engine cares about (``token_ids``, ``prompt_token_ids``, ``service_tier``...)
  are not kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any

from core.messages import Endpoint

# Text fields of a chat delta that are concatenated, in the order a replay streams them.
_REASONING_KEYS = ("reasoning_content", "reasoning")


@dataclass(slots=True)
class _Choice:
    """What one choice's chunks added up to so far."""

    index: int
    text: list[str] = field(default_factory=list)
    reasoning: dict[str, list[str]] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    logprobs: dict[str, list[Any] | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class StreamAssembler:
    """Folds the chunks of one stream, as the gateway sent them to the client, into the final
    non-streaming body.

    Choices may interleave in any order (``n > 1``). A chunk with ``choices: []`` carries only
    ``usage``; ``usage: null`` on the other chunks is ignored.
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self._chat = endpoint is Endpoint.CHAT
        self._content_key = "delta" if self._chat else "text"
        self._id: str | None = None
        self._created: int | None = None
        self._model: str | None = None
        self._system_fingerprint: str | None = None
        self._usage: dict[str, Any] | None = None
        self._choices: dict[int, _Choice] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        """Fold one chunk in. Raises ``ValueError`` for an error event (the caller stores
        errors as they are) or a chunk of another stream (a different ``id``)."""
        if "error" in chunk:
            raise ValueError("an error event is not a chunk: store the error as it is")
        chunk_id = chunk.get("id")
        if self._id is None:
            self._id = chunk_id
            self._created = chunk.get("created")
        elif chunk_id is not None and chunk_id != self._id:
            raise ValueError(f"chunk of stream {chunk_id!r} added to stream {self._id!r}")
        self._model = chunk.get("model") or self._model
        self._system_fingerprint = chunk.get("system_fingerprint") or self._system_fingerprint
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        for raw in chunk.get("choices") or ():
            index = int(raw.get("index", 0))
            choice = self._choices.get(index)
            if choice is None:
                choice = self._choices[index] = _Choice(index)
            self._fold(choice, raw)

    def set_usage(self, usage: dict[str, Any]) -> None:
        """The request's usage when the client's stream had no usage chunk (the gateway always
        knows it from the engine)."""
        self._usage = usage

    def result(self) -> dict[str, Any]:
        """The non-streaming body (``chat.completion`` or ``text_completion``), choices by index.

        Raises ``ValueError`` before any chunk was added: there is no id to answer with."""
        if self._id is None:
            raise ValueError("no chunk was added: nothing to assemble")
        choices = [self._choice_body(self._choices[i]) for i in sorted(self._choices)]
        body: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion" if self._chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
            "usage": self._usage,
        }
        if self._system_fingerprint is not None:
            body["system_fingerprint"] = self._system_fingerprint
        return body

    def _fold(self, choice: _Choice, raw: dict[str, Any]) -> None:
        if self._chat:
            delta = raw.get("delta") or {}
            if delta.get("content"):
                choice.text.append(delta["content"])
            for key in _REASONING_KEYS:
                if delta.get(key):
                    choice.reasoning.setdefault(key, []).append(delta[key])
            for call in delta.get("tool_calls") or ():
                _fold_tool_call(choice.tool_calls, call)
        elif raw.get("text"):
            choice.text.append(raw["text"])
        logprobs = raw.get("logprobs")
        if logprobs:
            merged = choice.logprobs if choice.logprobs is not None else {}
            for key, values in logprobs.items():
                # Lists (chat ``content``; completions ``tokens``, ``text_offset``...) are
                # concatenated; a null (chat ``refusal``) stays null until a list comes.
                earlier = merged.get(key)
                if values is None:
                    merged[key] = earlier
                else:
                    merged[key] = [*(earlier or ()), *values]
            choice.logprobs = merged
        if raw.get("finish_reason"):
            # The chunk that finishes a choice carries its stop_reason; earlier ones say null.
            choice.finish_reason = raw["finish_reason"]
            choice.stop_reason = raw.get("stop_reason")

    def _choice_body(self, choice: _Choice) -> dict[str, Any]:
        text = "".join(choice.text)
        if not self._chat:
            return {
                "index": choice.index,
                "text": text,
                "logprobs": choice.logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
            }
        tool_calls = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if not text and tool_calls else text,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        for key in _REASONING_KEYS:
            if key in choice.reasoning:
                message[key] = "".join(choice.reasoning[key])
        return {
            "index": choice.index,
            "message": message,
            "logprobs": choice.logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }


def _fold_tool_call(calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    # OpenAI streams a tool call as an index, then id/type/name once, then argument pieces.
    index = int(delta.get("index", len(calls)))
    call = calls.get(index)
    if call is None:
        call = calls[index] = {
            "id": None,
            "type": "function",
            "function": {"name": None, "arguments": ""},
        }
    if delta.get("id") and call["id"] is None:
        call["id"] = delta["id"]
    if delta.get("type"):
        call["type"] = delta["type"]
    function = delta.get("function") or {}
    if function.get("name") and call["function"]["name"] is None:
        call["function"]["name"] = function["name"]
    if function.get("arguments"):
        call["function"]["arguments"] += function["arguments"]


def rechunk(
    body: dict[str, Any], endpoint: Endpoint, *, include_usage: bool, max_chars: int = 64
) -> list[dict[str, Any]]:
    """The chunks a client streaming ``body`` would have received (docs/WIRE.md §1), without
    ``[DONE]``.

    Every chunk has the body's ``id``, ``created`` and ``model``. Chat: per choice a role chunk
    ``{"role": "assistant", "content": ""}``, the reasoning and content in pieces of at most
    ``max_chars`` characters, one chunk per tool call, then an empty delta with the
    ``finish_reason``. Completions: the text in pieces, then an empty ``text`` with the
    ``finish_reason``. Choices interleave step by step, as an engine's do. With
    ``include_usage`` every chunk has ``usage: null`` and a last ``choices: []`` chunk carries
    the body's ``usage``; without it no chunk has a ``usage`` key.
    """
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, not {max_chars}")
    chat = endpoint is Endpoint.CHAT
    head: dict[str, Any] = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
    }
    if body.get("system_fingerprint") is not None:
        head["system_fingerprint"] = body["system_fingerprint"]
    per_choice = [
        _chat_choice_chunks(c, max_chars) if chat else _completion_choice_chunks(c, max_chars)
        for c in sorted(body["choices"], key=lambda c: int(c.get("index", 0)))
    ]
    tail: dict[str, Any] = {"usage": None} if include_usage else {}
    chunks = [
        {**head, "choices": [choice], **tail}
        for step in zip_longest(*per_choice)
        for choice in step
        if choice is not None
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": body.get("usage")})
    return chunks


def _chat_choice_chunks(choice: dict[str, Any], max_chars: int) -> list[dict[str, Any]]:
    index = int(choice.get("index", 0))
    message = choice.get("message") or {}
    deltas: list[dict[str, Any]] = []
    for key in _REASONING_KEYS:
        deltas += [{key: piece} for piece in _pieces(message.get(key) or "", max_chars)]
    content = _pieces(message.get("content") or "", max_chars)
    # The whole choice's logprobs ride on its first content chunk (see the module docstring).
    first_content = len(deltas) if content else None
    deltas += [{"content": piece} for piece in content]
    for position, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        deltas.append(
            {
                "tool_calls": [
                    {
                        "index": position,
                        "id": call.get("id"),
                        "type": call.get("type", "function"),
                        "function": {
                            "name": function.get("name"),
                            "arguments": function.get("arguments") or "",
                        },
                    }
                ]
            }
        )
    logprobs = choice.get("logprobs")
    chunks: list[dict[str, Any]] = [
        {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    ]
    chunks += [
        {"index": index, "delta": delta, "logprobs": logprobs if i == first_content else None}
        for i, delta in enumerate(deltas)
    ]
    chunks.append(
        {
            "index": index,
            "delta": {},
            "logprobs": logprobs if first_content is None else None,
        }
    )
    return _with_finish(chunks, choice)


def _completion_choice_chunks(choice: dict[str, Any], max_chars: int) -> list[dict[str, Any]]:
    index = int(choice.get("index", 0))
    pieces = _pieces(choice.get("text") or "", max_chars)
    logprobs = choice.get("logprobs")
    chunks = [
        {"index": index, "text": piece, "logprobs": logprobs if i == 0 else None}
        for i, piece in enumerate(pieces)
    ]
    chunks.append({"index": index, "text": "", "logprobs": None if pieces else logprobs})
    return _with_finish(chunks, choice)


def _with_finish(chunks: list[dict[str, Any]], choice: dict[str, Any]) -> list[dict[str, Any]]:
    # Only the last chunk of a choice finishes it; stop_reason rides along as vLLM's does.
    for chunk in chunks[:-1]:
        chunk.update(finish_reason=None, stop_reason=None)
    chunks[-1].update(
        finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason")
    )
    return chunks


def _pieces(text: str, max_chars: int) -> list[str]:
    return [text[i : i + max_chars] for i in range(0, len(text), max_chars)]
