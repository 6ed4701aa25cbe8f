"""How many requests the decode pool can take now: the admission queue's release signal."""

from __future__ import annotations

from typing import Protocol

from workers.registry import Worker, WorkerSource


class KvUsage(Protocol):
    """A decode worker's KV-cache usage, when known."""

    def usage(self, worker: Worker) -> float | None:
        """0..1, or None when unknown."""
        ...


class DecodeCapacity:
    """``max_in_flight_per_worker`` for every healthy decode worker whose KV cache is below
    ``kv_watermark`` (a worker that does not report usage counts as below).

    Every admitted request holds a decode slot until it ends (the decode leg, or the colocated
    run), so decode workers bound what can run; a prefill leg is short and never outlives its
    request. A worker over the watermark takes nothing new: requests wait in the fair queue
    instead of making vLLM preempt running ones.
    """

    def __init__(
        self,
        decode: WorkerSource,
        max_in_flight_per_worker: int,
        kv_usage: KvUsage | None = None,
        kv_watermark: float = 0.95,
    ) -> None:
        self._decode = decode
        self._per_worker = max_in_flight_per_worker
        self._kv_usage = kv_usage
        self._kv_watermark = kv_watermark

    def capacity(self) -> int:
        return self._per_worker * sum(
            1 for worker in self._decode.workers if worker.healthy and not self._kv_full(worker)
        )

    def _kv_full(self, worker: Worker) -> bool:
        if self._kv_usage is None:
            return False
        usage = self._kv_usage.usage(worker)
        return usage is not None and usage >= self._kv_watermark
