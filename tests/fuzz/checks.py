"""Checks every answer of a fuzz run must pass, on top of schemathesis' own (no 5xx, statuses,
content types, headers and bodies as the OpenAPI document declares them):

- ``openai_error``: an error is OpenAI's body, whatever produced it: ``{"error": {"message",
  "type", "param", "code"}}``, all four keys and no others, ``param`` and ``code`` a string or
  null (docs/WIRE.md, section 1);
- ``sse_stream``: a stream passes the bench harness's checking SSE client
  (``bench/harness/client.py``: SSE lines, JSON data, ``[DONE]``, a finish reason, usage when
  asked) and the wire rules it does not check: ``\\n`` separators only, no ``event:``, ``id:``
  or ``retry:`` lines, one ``id`` and ``created`` on every chunk, the usage chunk last and only
  when asked, an error event as the last event.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from schemathesis import Case, CheckContext, Response

from bench.harness.client import read_stream
from bench.harness.records import RequestRecord

_ERROR_KEYS = {"message", "type", "param", "code"}
_CHUNK_OBJECTS = {
    "/v1/chat/completions": "chat.completion.chunk",
    "/v1/completions": "text_completion",
}


def openai_error(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every 4xx and 5xx answer is an OpenAI error body."""
    if response.status_code < 400:
        return None
    content_type = _content_type(response)
    assert content_type == "application/json", (
        f"an error answered {content_type!r}, not application/json: {response.content[:200]!r}"
    )
    assert_openai_error(json.loads(response.content))
    return True


def assert_openai_error(body: Any) -> None:
    """``body`` is ``{"error": {...}}`` as docs/WIRE.md, section 1, says."""
    assert isinstance(body, dict) and set(body) == {"error"}, f"not an OpenAI error: {body!r}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == _ERROR_KEYS, f"error keys: {error!r}"
    assert isinstance(error["message"], str) and error["message"], f"no message: {error!r}"
    assert isinstance(error["type"], str) and error["type"], f"no type: {error!r}"
    for key in ("param", "code"):
        assert error[key] is None or isinstance(error[key], str), f"{key} not a string: {error!r}"


def sse_stream(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """A stream answer is a valid OpenAI stream."""
    if _content_type(response) != "text/event-stream":
        return None
    body = case.body if isinstance(case.body, dict) else {}
    asked_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    raw = bytes(response.content)
    problems = stream_problems(raw, case.path, asked_usage)
    assert not problems, f"stream breaks the wire contract: {problems}\n{raw[:2000]!r}"
    return True


def stream_problems(raw: bytes, path: str, asked_usage: bool) -> list[str]:
    """What is wrong with the SSE body ``raw`` of a ``path`` request (empty: nothing)."""
    record = RequestRecord(0, "fuzz", False, None, 0, 0)
    asyncio.run(read_stream(_lines(raw), record, 0.0, expect_usage=asked_usage))
    problems = list(record.malformed)
    if b"\r" in raw:
        problems.append("a \\r in the stream: separators are \\n only")
    events = [event for event in raw.split(b"\n\n") if event]
    for event in events:
        if not event.startswith((b"data: ", b": ")):
            problems.append(f"an event that is neither data nor a comment: {event[:80]!r}")
    datas = [event.removeprefix(b"data: ") for event in events if event.startswith(b"data: ")]
    if not datas:
        return [*problems, "no data event"]
    try:
        chunks = [json.loads(data) for data in datas if data != b"[DONE]"]
    except ValueError as exc:
        return [*problems, f"an event whose data is not one JSON value: {exc}"]
    if not all(isinstance(chunk, dict) for chunk in chunks):
        return [*problems, "an event whose data is not a JSON object"]
    errors = [chunk for chunk in chunks if "error" in chunk]
    if errors:
        if chunks[-1] is not errors[0] or datas[-1] == b"[DONE]":
            problems.append("an error event that is not the stream's last")
        try:
            assert_openai_error(errors[0])
        except AssertionError as exc:
            problems.append(str(exc))
        chunks = chunks[:-1]
    elif record.error_type is not None:
        problems.append(f"{record.error_type}: {record.error}")
    if len({(chunk.get("id"), chunk.get("created")) for chunk in chunks}) > 1:
        problems.append("chunks differ in id or created")
    wanted = _CHUNK_OBJECTS.get(path)
    if any(chunk.get("object") != wanted for chunk in chunks):
        problems.append(f"a chunk whose object is not {wanted!r}")
    with_usage = [i for i, chunk in enumerate(chunks) if chunk.get("usage") is not None]
    if asked_usage and not errors:
        if with_usage != [len(chunks) - 1] or chunks[-1].get("choices"):
            problems.append("include_usage: one usage chunk, last, with no choices")
        if any("usage" not in chunk for chunk in chunks):
            problems.append("include_usage: every chunk has a usage key (null until the last)")
    elif not asked_usage and any("usage" in chunk for chunk in chunks):
        problems.append("usage in a chunk although include_usage was not asked")
    return problems


async def _lines(raw: bytes) -> AsyncIterator[bytes]:
    for line in raw.splitlines(keepends=True):
        yield line


def _content_type(response: Response) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0].split(";")[0].strip().lower()
