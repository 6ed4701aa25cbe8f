"""The floor a Python streaming gateway is measured against (issue 24): a bare SSE relay.

``python -m bench.overhead.bare_relay --upstream URL --port P`` serves ``POST
/v1/chat/completions`` and ``/v1/completions`` with uvicorn as a plain ASGI app (no framework) and
relays each to ``URL`` with aiohttp: the request body forwarded as it came, every SSE event of a
stream parsed as JSON and written out again (what any gateway that rewrites a chunk's ``id`` or
counts its tokens must do at least), a non-streaming answer passed through. No auth, no quotas,
no queue, no billing: what Tandem's cost per request is a multiple of. ``GET /health`` answers
200 once it serves.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import aiohttp
import uvicorn

Scope = dict[str, Any]
Message = dict[str, Any]


class BareRelay:
    """The ASGI app."""

    def __init__(self, upstream: str) -> None:
        self._upstream = upstream.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path = scope["path"]
        if scope["method"] == "GET" and path == "/health":
            await _respond(send, 200, b"{}")
            return
        if scope["method"] != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            await _respond(send, 404, b'{"error":{"message":"not found"}}')
            return
        body = await _read_body(receive)
        assert self._session is not None  # opened in the lifespan
        async with self._session.post(
            self._upstream + path, data=body, headers={"Content-Type": "application/json"}
        ) as upstream:
            if upstream.content_type != "text/event-stream":
                await _respond(send, upstream.status, await upstream.read())
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            async for line in upstream.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data != b"[DONE]":
                    data = json.dumps(json.loads(data), separators=(",", ":")).encode()
                await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                            "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout()
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._session is not None:
                    await self._session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message: Message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A bare SSE relay: the floor of issue 24's bench.")
    p.add_argument("--upstream", required=True, help="the engine's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    uvicorn.run(BareRelay(args.upstream), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
