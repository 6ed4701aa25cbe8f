"""The gateway's view of a worker: where it is, whether it is healthy, how busy it is."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
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
    num_consecutive_failures: int = field(default=0)

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
