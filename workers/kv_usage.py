"""The decode workers' KV-cache usage, polled and written on each ``Worker`` record.

A decode worker whose KV cache is nearly full would preempt running requests (vLLM recomputes
them later) if given more. ``Worker.kv_usage`` feeds both uses of the pool's ``kv_watermark``:
admission (``DecodeCapacity``) holds new requests in the fair queue while no worker has room,
and ``pick()`` routes admitted ones to a worker under the watermark. vLLM exposes the figure as
the gauge ``vllm:kv_cache_usage_perc`` (0..1) on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from workers.registry import Worker, WorkerSource
from workers.scrape import fetch_metrics_text

_GAUGE = "vllm:kv_cache_usage_perc"


class KvUsageWatcher:
    """Reads every healthy decode worker's KV-cache usage each ``interval_s`` and writes it on
    the worker (``Worker.kv_usage``); an unhealthy or unreadable worker gets None (unknown).
    ``start()``/``aclose()`` own the loop; ``aclose()`` leaves every usage unknown."""

    def __init__(
        self, session: aiohttp.ClientSession, decode: WorkerSource, interval_s: float = 1.0
    ) -> None:
        self._session = session
        self._decode = decode
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tandem-kv-usage")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for worker in self._decode.workers:
            worker.kv_usage = None  # nobody keeps it current any more

    async def poll_once(self) -> None:
        """One round: read the healthy workers, clear the others."""
        workers = list(self._decode.workers)
        readings = await asyncio.gather(*(self._read(worker) for worker in workers))
        for worker, value in zip(workers, readings, strict=True):
            worker.kv_usage = value

    async def _loop(self) -> None:
        while True:
            await self.poll_once()
            await asyncio.sleep(self._interval_s)

    async def _read(self, worker: Worker) -> float | None:
        if not worker.healthy:
            return None
        # No answer reads as unknown, not full: health checks decide whether the worker is gone.
        text = await fetch_metrics_text(self._session, worker, self._interval_s)
        return None if text is None else parse_kv_usage(text)


def parse_kv_usage(metrics_text: str) -> float | None:
    """The largest ``vllm:kv_cache_usage_perc`` sample in a Prometheus text (one per engine).

    A line scan, not a full parse: the text is tens of KB and read every second."""
    found: float | None = None
    for line in metrics_text.splitlines():
        if line.startswith(_GAUGE) and line[len(_GAUGE) : len(_GAUGE) + 1] in ("{", " "):
            with contextlib.suppress(ValueError, IndexError):
                value = float(line.rsplit(" ", 1)[1])
                found = value if found is None else max(found, value)
    return found
