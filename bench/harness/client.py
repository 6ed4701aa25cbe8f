"""Send one streaming request and measure it, checking the stream on the way.

One shared ``aiohttp`` session (the cheapest Python HTTP client per request, measured
on a 2-core machine) so the load generator is not the bottleneck it measures. The stream is read
line by line as Server-Sent Events; a stream that breaks the protocol counts as a failure, not as
a fast request:

- a line that is not an SSE field or comment, or ``data`` that is not JSON;
- no ``data: [DONE]`` at the end, or no ``finish_reason``;
- no usage chunk although ``include_usage`` asked for one;
- usage that cannot match what streamed: fewer completion tokens than chunks with text, more than
  ``max_tokens``, or (with a tokenizer) a count far from the streamed text's re-tokenised length.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, Callable
from typing import Any

import aiohttp
import orjson

from bench.harness.records import RequestRecord
from bench.harness.workload import Api, PlannedRequest, Target

TokenCount = Callable[[str], int]
SSE_FIELDS = (b"data", b"event", b"id", b"retry")


async def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model ``GET /v1/models`` lists; a ValueError that says what to do otherwise."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
            body = await resp.json(content_type=None)
            if resp.status != 200:
                raise ValueError(f"GET {url} answered {resp.status}: {body}")
    except aiohttp.ClientError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from exc
    models = body.get("data") or []
    if not models:
        raise ValueError(f"{url} lists no model: pass --model")
    return str(models[0]["id"])


def request_body(target: Target, planned: PlannedRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": planned.prompt.output_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.api is Api.CHAT:
        body["messages"] = [{"role": "user", "content": planned.prompt.text}]
    else:
        body["prompt"] = planned.prompt.text
    if target.ignore_eos:
        body["ignore_eos"] = True
    body.update(target.extra_body)
    return body


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    planned: PlannedRequest,
    record: RequestRecord,
    run_start: float,
    count_tokens: TokenCount | None = None,
) -> RequestRecord:
    """Send ``planned`` now and fill ``record`` in; never raises for what the server does."""
    headers = {"Content-Type": "application/json"}
    if planned.tenant.api_key:
        headers["Authorization"] = f"Bearer {planned.tenant.api_key}"
    payload = orjson.dumps(request_body(target, planned))
    sent = time.perf_counter()
    record.sent_s = sent - run_start
    try:
        async with asyncio.timeout(target.timeout_s):
            async with session.post(target.url, data=payload, headers=headers) as response:
                record.status = response.status
                record.request_id = response.headers.get("x-request-id")
                queue_ms = response.headers.get("x-tandem-queue-ms")
                record.queue_ms = float(queue_ms) if queue_ms else None
                if response.status != 200:
                    _http_error(record, await response.read())
                    return record
                await read_stream(response.content, record, sent)
    except TimeoutError:
        _fail(record, "timeout", f"no complete answer within {target.timeout_s:g} s")
    except (aiohttp.ClientError, OSError) as exc:
        _fail(record, "connection", f"{type(exc).__name__}: {exc}")
    finally:
        record.elapsed_s = time.perf_counter() - sent
    if record.error_type is None:
        _check_usage(record, count_tokens, target.ignore_eos)
    return record


async def read_stream(
    lines: AsyncIterable[bytes], record: RequestRecord, sent: float, *, expect_usage: bool = True
) -> None:
    """Read one SSE response's ``lines`` into ``record``: timings, text, finish reason, usage,
    and in ``record.malformed`` each way the stream breaks the protocol (the module docstring's
    list; a missing usage chunk only when ``expect_usage``: the request asked for one)."""
    done = False
    last_chunk: float | None = None
    text: list[str] = []
    async for raw in lines:
        line = raw.rstrip(b"\r\n")
        if not line or line.startswith(b":"):
            continue  # event boundary, or a comment such as a heartbeat
        name, _, value = line.partition(b":")
        if name not in SSE_FIELDS:
            record.malformed.append(f"not an SSE line: {line[:80]!r}")
            continue
        if name != b"data":
            continue
        value = value.removeprefix(b" ")
        if done:
            record.malformed.append("data after [DONE]")
            continue
        if value == b"[DONE]":
            done = True
            continue
        try:
            chunk = orjson.loads(value)
        except orjson.JSONDecodeError:
            record.malformed.append(f"data is not JSON: {value[:80]!r}")
            continue
        if not isinstance(chunk, dict):
            record.malformed.append(f"data is not a JSON object: {value[:80]!r}")
            continue
        if "error" in chunk:
            error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            kind = _error_kind(error) or "unknown"
            _fail(record, f"stream_error:{kind}", str(error.get("message") or chunk["error"]))
        if usage := chunk.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")
        choices = chunk.get("choices")
        if not choices:
            continue
        now = time.perf_counter()
        if last_chunk is None:
            record.ttft_s = now - sent
        else:
            record.itl_s.append(now - last_chunk)
        last_chunk = now
        choice = choices[0]
        piece = (
            (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        )
        if piece:
            if record.ttft_content_s is None:
                record.ttft_content_s = now - sent
            record.content_chunks += 1
            text.append(piece)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    record.text = "".join(text)
    if last_chunk is not None:
        record.e2e_s = last_chunk - sent
    if record.error_type is not None:
        return
    if not done:
        record.malformed.append("stream ended without data: [DONE]")
    if record.ttft_s is None:
        record.malformed.append("no chunk with a choice")
    elif record.finish_reason is None:
        record.malformed.append("no finish_reason")
    if expect_usage and record.completion_tokens is None:
        record.malformed.append("no usage although include_usage asked for it")
    if record.malformed:
        _fail(record, "malformed", "; ".join(record.malformed[:3]))


def _check_usage(record: RequestRecord, count_tokens: TokenCount | None, ignore_eos: bool) -> None:
    tokens = record.completion_tokens
    if tokens is None:
        return
    problems = []
    if tokens < record.content_chunks:
        problems.append(f"usage says {tokens} tokens but {record.content_chunks} chunks had text")
    if tokens > record.max_tokens:
        problems.append(f"usage says {tokens} tokens, over max_tokens {record.max_tokens}")
    if count_tokens is not None:
        counted = count_tokens(record.text)
        # Re-tokenising decoded text is not exact: pieces may merge across chunk joins (a token
        # or two either way), and special tokens (EOS) stream no text at all. So the text may
        # hold a little more than usage says, never much more; and much less only where
        # ignore_eos lets the model emit any number of invisible special tokens.
        slack = max(2, int(0.1 * tokens))
        if counted > tokens + slack:
            problems.append(f"usage says {tokens} tokens, the streamed text is {counted}")
        elif not ignore_eos and counted < tokens - slack - 1:
            problems.append(f"usage says {tokens} tokens, the streamed text is only {counted}")
    if problems:
        record.malformed.extend(problems)
        _fail(record, "malformed", "; ".join(problems))


def _http_error(record: RequestRecord, body: bytes) -> None:
    error_type = f"http_{record.status}"
    message = body[:300].decode("utf-8", "replace")
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        error_type = _error_kind(error) or error_type
        message = str(error.get("message", message))
    _fail(record, error_type, message)


def _error_kind(error: dict[str, Any]) -> str | None:
    """OpenAI's string ``code`` (``rate_limit_exceeded``), else its ``type``.

    vLLM's ``code`` is the HTTP status as an int, which says nothing the status does not."""
    code = error.get("code")
    if isinstance(code, str) and code:
        return code
    kind = error.get("type")
    return str(kind) if kind else None


def _fail(record: RequestRecord, error_type: str, message: str) -> None:
    if record.error_type is None:
        record.error_type = error_type
        record.error = message
