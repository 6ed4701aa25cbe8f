"""The decode workers' KV-cache usage, polled: the admission queue's second capacity signal.

A decode worker whose KV cache is nearly full would preempt running requests (vLLM recomputes
them later) if given more; holding new requests in the fair queue instead keeps running
streams smooth and lets fairness decide who goes next. vLLM exposes the figure as the gauge
``vllm:kv_cache_usage_perc`` (0..1) on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

from gateway.worker_metrics import fetch_metrics_text
from workers.registry import Worker, WorkerSource

log = logging.getLogger("tandem.gateway")

_GAUGE = "vllm:kv_cache_usage_perc"


class KvUsageWatcher:
    """Polls every decode worker's KV-cache usage; ``start()``/``aclose()`` own the loop."""

    def __init__(
        self, session: aiohttp.ClientSession, decode: WorkerSource, interval_s: float = 1.0
    ) -> None:
        self._session = session
        self._decode = decode
        self._interval_s = interval_s
        self._usage: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def usage(self, worker: Worker) -> float | None:
        """The worker's last reported usage (0..1); None when unknown (not polled yet, or the
        worker does not report it)."""
        return self._usage.get(worker.name)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tandem-kv-usage")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            workers = [worker for worker in self._decode.workers if worker.healthy]
            readings = await asyncio.gather(*(self._read(worker) for worker in workers))
            self._usage = {
                worker.name: value
                for worker, value in zip(workers, readings, strict=True)
                if value is not None
            }
            await asyncio.sleep(self._interval_s)

    async def _read(self, worker: Worker) -> float | None:
        # No answer reads as unknown, not full: health checks decide whether the worker is gone.
        text = await fetch_metrics_text(self._session, worker, self._interval_s)
        return None if text is None else parse_kv_usage(text)


def parse_kv_usage(metrics_text: str) -> float | None:
    """The largest ``vllm:kv_cache_usage_perc`` sample in a Prometheus text (one per engine).

    A line scan, not a full parse: the text is tens of KB and read every second."""
    found: float | None = None
    for line in metrics_text.splitlines():
        if line.startswith(_GAUGE) and line[len(_GAUGE)] in "{ ":
            with contextlib.suppress(ValueError, IndexError):
                value = float(line.rsplit(" ", 1)[1])
                found = value if found is None else max(found, value)
    return found
