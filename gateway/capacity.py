"""How many requests the decode pool can take now: the admission queue's release signal."""

from __future__ import annotations

from workers.registry import WorkerSource


class DecodeCapacity:
    """``max_in_flight_per_worker`` for every healthy decode worker.

    Every admitted request holds a decode slot until it ends (the decode leg, or the colocated
    run), so decode workers bound what can run; a prefill leg is short and never outlives its
    request. No healthy worker means capacity 0: requests wait in the queue (and a worker coming
    back releases them) instead of failing at once.
    """

    def __init__(self, decode: WorkerSource, max_in_flight_per_worker: int) -> None:
        self._decode = decode
        self._per_worker = max_in_flight_per_worker

    def capacity(self) -> int:
        return self._per_worker * sum(1 for worker in self._decode.workers if worker.healthy)
