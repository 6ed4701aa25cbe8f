"""The gateway's view of a worker: where it is, whether it is healthy, how busy it is."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from core.messages import WorkerRole


@dataclass(slots=True)
class Worker:
    """One vLLM server as the router sees it. Mutated only on the gateway's event loop."""

    name: str
    role: WorkerRole
    base_url: str  # e.g. http://127.0.0.1:8100, no trailing slash
    healthy: bool = False
    num_outstanding: int = 0  # requests the gateway has in flight on this worker

    @contextmanager
    def lease(self) -> Iterator[Worker]:
        """Count one in-flight request on this worker for as long as the block runs."""
        self.num_outstanding += 1
        try:
            yield self
        finally:
            self.num_outstanding -= 1


def least_loaded(workers: Iterable[Worker]) -> Worker | None:
    """The healthy worker with the fewest outstanding requests (first listed wins ties)."""
    best: Worker | None = None
    for worker in workers:
        if worker.healthy and (best is None or worker.num_outstanding < best.num_outstanding):
            best = worker
    return best


class WorkerSource(Protocol):
    """A pool as the router sees it: its workers, and a pick among the healthy ones."""

    @property
    def workers(self) -> Sequence[Worker]: ...

    def pick(self) -> Worker | None: ...


def pick_by_affinity(workers: Iterable[Worker], key: str, max_extra_load: int) -> Worker | None:
    """The healthy worker that ``key`` hashes to, unless it is busier than the least-loaded one
    by more than ``max_extra_load`` requests; then the least-loaded one.

    Rendezvous hashing: each key prefers one worker, and when workers come or go only the keys
    of those workers move, so requests sharing a prompt prefix keep finding the worker whose
    prefix cache already holds it.
    """
    healthy = [worker for worker in workers if worker.healthy]
    least = least_loaded(healthy)
    if least is None:
        return None
    preferred = max(healthy, key=lambda worker: _rendezvous_score(key, worker.name))
    if preferred.num_outstanding - least.num_outstanding > max_extra_load:
        return least
    return preferred


def _rendezvous_score(key: str, name: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
