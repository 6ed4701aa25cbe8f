"""``python -m bench.overhead.ttft_marks up ...``: ``tandem up`` with a timestamp at each step a
streamed request takes before its first event, written to ``TANDEM_TTFT_MARKS`` (JSON, one
object per request: step -> seconds) when the gateway exits. ``bench.overhead.ttft_steps``
starts it and reads the file.

The marks wrap the serving path's own functions from outside (nothing in ``gateway/`` knows
of them), so the steps are named after those functions: a renamed one fails here at start,
loudly. Each mark costs about a microsecond; only the first time a step is seen per request
counts.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import gateway.cli.http_protocol as http_protocol
import gateway.serving.events as events
import gateway.serving.flow as flow
import gateway.serving.gate as gate
import gateway.serving.routes as routes
import gateway.serving.sse as sse
import gateway.serving.upstream as upstream

MARKS_ENV = "TANDEM_TTFT_MARKS"

HEAD = "head"
"""Seconds at which the server finished parsing the request's head (before ``route``: the
server's task start, the middleware and FastAPI's routing lie between)."""
_HEAD_KEY = "tandem.ttft_marks.head"

STEPS = (
    "auth_done", "body_read", "receive_start", "receive_end", "admit_start", "admit_end",
    "engine_call", "engine_first_chunk", "stream_opened", "response_start", "first_event_sent",
)  # fmt: skip
"""In the order a request takes them; each is seconds after ``route`` (the route's entry)."""

_records: list[dict[str, float]] = []
_current: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
    "ttft_marks", default=None
)


def _mark(step: str | None) -> None:
    record = _current.get()
    if step is not None and record is not None and step not in record:
        record[step] = time.perf_counter()


def _around_async(owner: Any, name: str, before: str | None, after: str | None) -> None:
    original: Callable[..., Awaitable[Any]] = getattr(owner, name)

    @functools.wraps(original)
    async def marked(*args: Any, **kwargs: Any) -> Any:
        _mark(before)
        try:
            return await original(*args, **kwargs)
        finally:
            _mark(after)

    setattr(owner, name, marked)


def _around_sync(owner: Any, name: str, before: str | None, after: str | None) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def marked(*args: Any, **kwargs: Any) -> Any:
        _mark(before)
        try:
            return original(*args, **kwargs)
        finally:
            _mark(after)

    setattr(owner, name, marked)


def install() -> None:
    """Wrap the serving path's steps (see ``STEPS``)."""
    serve = routes._serve
    parse_head = http_protocol.LimitedHttpToolsProtocol.on_headers_complete

    def head_parsed(self: http_protocol.LimitedHttpToolsProtocol) -> None:
        parsed = time.perf_counter()
        parse_head(self)
        self.scope[_HEAD_KEY] = parsed  # type: ignore[literal-required]

    async def route(*args: Any, **kwargs: Any) -> Any:
        record = {"route": time.perf_counter()}
        http_request = next(arg for arg in args if hasattr(arg, "scope"))
        if (head := http_request.scope.get(_HEAD_KEY)) is not None:
            record[HEAD] = head
        _records.append(record)
        _current.set(record)
        return await serve(*args, **kwargs)

    http_protocol.LimitedHttpToolsProtocol.on_headers_complete = head_parsed  # type: ignore[method-assign]
    routes._serve = route
    _around_async(gate.Gate, "authenticate", None, "auth_done")
    _around_async(routes, "_json_body", None, "body_read")
    _around_sync(flow.RequestFlow, "receive", "receive_start", "receive_end")
    _around_async(gate.Gate, "admit", "admit_start", "admit_end")
    _around_async(upstream.EngineClient, "open_stream", "engine_call", "engine_first_chunk")
    _around_async(events.LiveStream, "open_stream", None, "stream_opened")
    # The response opens its stream first (gateway/serving/sse.py), then starts.
    _around_async(sse.EventStream, "_start", "response_start", None)
    respond = sse.EventStream.__call__

    async def response(self: sse.EventStream, scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: MutableMapping[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and message["body"].startswith(b"data"):
                _mark("first_event_sent")

        await respond(self, scope, receive, sending)

    sse.EventStream.__call__ = response  # type: ignore[method-assign]


def _write(path: str) -> None:
    with open(path, "w") as out:
        json.dump(_records, out)


def main() -> int:
    path = os.environ.get(MARKS_ENV)
    if not path:
        raise SystemExit(f"{MARKS_ENV} names the file the marks go to")
    install()
    atexit.register(_write, path)
    from gateway.cli.main import main as tandem_main

    return tandem_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
