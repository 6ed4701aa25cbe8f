"""What one request may send, refused with a clear error before any route reads it.

``RequestLimitsMiddleware`` wraps the whole app (OpenAI and admin routes alike) and reads each
request's body itself, before the app runs:

- a body larger than ``max_body_bytes`` is 413 ``body_too_large``: refused on its declared
  ``Content-Length`` before a byte of it is read, else as soon as the bytes streamed in pass
  the limit, so the gateway never holds more than the limit per request;
- a body that has not fully arrived ``body_timeout_s`` after the request's head (a client
  sending it byte by byte) is 408 ``request_timeout``.

Both close the connection. A body that had all arrived by the time the app was called (the
usual small JSON body, read with its head) is taken without arming the timeout's timer: the
gateway's own server says so in the request's scope (``BODY_COMPLETE_EXTENSION``), which saved
about 0.02 ms of a request's TTFT at one stream. Under another ASGI server the timer is always
armed.

Because the body is complete before the app is called, no route, and so no admission queue
or quota, ever waits on a slow client: a request holds no admission capacity while its body
trickles in.

``check_json_depth`` bounds how deeply a parsed JSON body nests (400 ``json_too_deep``): the
gateway serialises bodies again (the engine legs, idempotency fingerprints) with an encoder
that refuses anything nested past 254 levels, so a deeper body must be refused on the way in.
The request line and headers are bounded by the HTTP server itself
(``gateway/cli/http_protocol.py``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import BodyTooLargeError, InvalidRequestError, RequestTimeoutError, TandemError
from gateway.errors import error_response

MAX_JSON_DEPTH = 64
"""How deeply a JSON body may nest (objects and arrays): a tool's JSON schema several levels
deep needs a few dozen; the gateway's JSON encoder stops at 254."""

_CONTAINERS = frozenset({dict, list})

BODY_COMPLETE_EXTENSION = "tandem.body_complete"
"""The scope's extension, from the gateway's own HTTP server (``gateway/cli/http_protocol.py``):
a callable that tells whether the request's whole body has been read off the connection, so
that ``receive()`` will not wait for it. Taken out of the scope once read."""


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may send, and how long it may take to send it (``TANDEM_MAX_*``)."""

    max_body_bytes: int = 4 * 1024 * 1024
    """Largest request body. A 128k-token prompt is about 0.5 MiB of text, or 0.9 MiB as a
    list of token ids: 4 MiB leaves room for long histories and batched completions."""
    body_timeout_s: float = 30.0
    """Longest time from the request's head to the last byte of its body."""
    max_header_bytes: int = 32 * 1024
    """Largest request line plus headers (the HTTP server's: ``gateway/cli/http_protocol.py``)."""
    header_timeout_s: float = 30.0
    """Longest time from a connection's first byte (or its opening) to the end of a request's
    headers (the HTTP server's)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "body_timeout_s", "max_header_bytes", "header_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RequestLimits.{name} must be > 0, got {getattr(self, name)}")


class RequestLimitsMiddleware:
    """Reads each HTTP request's whole body within the limits, then runs the app on it."""

    def __init__(self, app: ASGIApp, limits: RequestLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read_body(scope, receive)
        except TandemError as exc:
            response = error_response(exc)
            # The rest of the body may still be on its way: the connection cannot be reused.
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if body is None:
            return  # the client left before its body arrived: there is no one to answer
        replayed = _replay(body, receive)
        del body  # the app takes it once: not held here while a response streams for minutes
        await self.app(scope, replayed, send)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.limits.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            raise _too_large(limit)
        body_complete = scope.get("extensions", {}).pop(BODY_COMPLETE_EXTENSION, None)
        if body_complete is not None and body_complete():
            return await _take_body(receive, limit, [])  # nothing to wait for: no timer
        chunks: list[bytes] = []  # what came, for the timeout's error
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await _take_body(receive, limit, chunks)
        except TimeoutError:
            raise RequestTimeoutError(
                f"The request body did not arrive within {self.limits.body_timeout_s:g} s "
                f"(TANDEM_BODY_TIMEOUT_S); {sum(map(len, chunks))} bytes came. Send the "
                "whole body at once."
            ) from None


async def _take_body(receive: Receive, limit: int, chunks: list[bytes]) -> bytes | None:
    """The body's messages up to the last (``chunks`` gathers them); None when the client
    left first; 413 past ``limit`` bytes."""
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def check_json_depth(body: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """400 ``json_too_deep`` when the parsed JSON ``body`` nests objects and arrays more than
    ``limit`` levels deep. Level by level, so a deep body cannot exhaust the stack; a level's
    scalars are skipped without a Python-level loop (``map(type, ...)``), so a long list of
    token ids costs little."""
    level = [body] if type(body) in _CONTAINERS else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise InvalidRequestError(
                f"The request body nests objects and arrays more than {limit} levels deep; "
                "flatten it.",
                code="json_too_deep",
            )
        below: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            if not _CONTAINERS.isdisjoint(map(type, children)):
                below.extend(child for child in children if type(child) in _CONTAINERS)
        level = below


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP server refuses a malformed one before we see it
    return None


def _too_large(limit: int) -> BodyTooLargeError:
    return BodyTooLargeError(
        f"The request body is larger than the {limit} bytes this gateway accepts "
        "(TANDEM_MAX_BODY_BYTES): send less (fewer or shorter messages, a shorter prompt)."
    )


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's ``receive``: the body read here once, then the server's own messages (the
    disconnect a streaming route waits for). Once handed over, the body is not kept here."""
    unsent = [body]

    async def replayed() -> Message:
        if not unsent:
            return await receive()
        return {"type": "http.request", "body": unsent.pop(), "more_body": False}

    return replayed
