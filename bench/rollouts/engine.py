"""A fake decode engine for the rollback benchmark: ``bench.overhead.fake_vllm``'s routes, which
can be told to fail every generation request, and which notes when each request first arrived.

The gateway sends its request id as ``x-request-id`` and re-sends a request that failed before its
first byte once (``gateway/serving/routing.py``): only the first arrival of an id is kept, so an
arrival time is when the gateway first routed that request here.
"""

from __future__ import annotations

import asyncio
import time

from bench.overhead import vllm_wire as wire
from bench.overhead.fake_http import Exchange, HttpRequest, serve
from bench.overhead.fake_vllm import FakeVllm, Timing

_GENERATE = frozenset({"/v1/chat/completions", "/v1/completions"})


class Engine:
    """One fake worker on 127.0.0.1; ``start`` it, ``aclose`` it."""

    def __init__(self, name: str, model: str, timing: Timing) -> None:
        self.name = name
        self.model = model
        """What it serves (the deployments' ``served_as``)."""
        self._timing = timing
        self._fake: FakeVllm | None = None
        self._server: asyncio.Server | None = None
        self.base_url = ""
        self.failing = False
        """Answer every generation request with vLLM's 500."""
        self.arrivals: dict[str, float] = {}
        """Request id -> ``time.time()`` of its first arrival."""

    async def start(self) -> Engine:
        self._fake = FakeVllm(self.model, self._timing)
        self._server = await serve(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def last_arrival(self, since: float) -> float | None:
        """The latest first arrival at or after ``since``; None without one."""
        return max((at for at in self.arrivals.values() if at >= since), default=None)

    def _handle(self, request: HttpRequest, exchange: Exchange) -> None:
        assert self._fake is not None  # set by start(), before the server exists
        if request.method == "POST" and request.path in _GENERATE:
            request_id = request.headers.get("x-request-id") or f"anonymous-{len(self.arrivals)}"
            self.arrivals.setdefault(request_id, time.time())
            if self.failing:
                error = wire.error_body(500, "Internal server error", "InternalServerError")
                exchange.send(500, error)
                return
        self._fake.handle(request, exchange)
