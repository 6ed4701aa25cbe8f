"""How many requests the decode pool can take now: the admission queue's release signal."""

from __future__ import annotations

from workers.registry import WorkerSource


class DecodeCapacity:
    """``max_in_flight_per_worker`` for every decode worker in rotation that is not KV-full at
    the pool's ``kv_watermark`` (``Worker.kv_full``; a worker whose usage is unknown has room),
    plus what each draining worker still runs: its requests hold admitted slots until they end,
    so the slots a drain frees are never handed out twice, and the slots of the workers that
    stay are not held back while it drains.

    Every admitted request holds a decode slot until it ends (the decode leg, or the colocated
    run), so decode workers bound what can run; a prefill leg is short and never outlives its
    request. A KV-full worker takes nothing new: requests wait in the fair queue instead of
    making vLLM preempt running ones, and the pool's ``pick()`` passes it over by the same
    test. Usage is what ``KvUsageWatcher`` last wrote on the workers.
    """

    def __init__(self, decode: WorkerSource, max_in_flight_per_worker: int) -> None:
        self._decode = decode
        self._per_worker = max_in_flight_per_worker

    def capacity(self) -> int:
        watermark = self._decode.kv_watermark
        slots = 0
        for worker in self._decode.workers:
            if worker.draining:
                slots += min(worker.num_outstanding, self._per_worker)
            elif worker.healthy and not worker.kv_full(watermark):
                slots += self._per_worker
        return slots
