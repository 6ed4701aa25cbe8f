"""The gateway's view of a worker: where it is, whether it is healthy, how busy it is, how full
its KV cache is; and how a request picks one."""

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
    kv_usage: float | None = None
    """Last reported ``vllm:kv_cache_usage_perc`` (0..1), written by ``KvUsageWatcher``; None
    when unknown (not read yet, unreadable, unhealthy, or a worker nobody polls)."""
    draining: bool = False
    """Leaving: no new request is routed to it while the ones it has finish (a scale-down,
    ``WorkerPool.drain``). It stays health-checked, and counts as lost only if it goes down."""
    num_kv_held: int = 0
    """Decode legs that have yet to read the KV this prefill worker computed for them: it must
    not stop before they have (or it would fail their transfer)."""

    @property
    def in_rotation(self) -> bool:
        """Whether new requests may be routed to it: healthy and not draining."""
        return self.healthy and not self.draining

    @property
    def busy(self) -> bool:
        """Whether stopping it now would cut something: a request in flight, or KV a decode
        leg still has to read."""
        return self.num_outstanding > 0 or self.num_kv_held > 0

    def kv_full(self, watermark: float) -> bool:
        """Whether the worker's KV cache is at or over ``watermark``: it should take nothing new.
        Unknown usage counts as room (health checks, not this, decide whether a worker is gone).
        The one test of KV-fullness, for admission capacity and picking alike."""
        return self.kv_usage is not None and self.kv_usage >= watermark

    def lease(self) -> WorkerLease:
        """Count one in-flight request on this worker: for as long as a ``with`` block runs,
        or from ``hold()`` to ``release()`` (a lease held across calls, as a stream's)."""
        return WorkerLease(self)

    @contextmanager
    def holding_kv(self) -> Iterator[Worker]:
        """Count one decode leg that will read KV from this worker for as long as the block
        runs (the leg, up to its first byte: by then the KV has been read)."""
        self.num_kv_held += 1
        try:
            yield self
        finally:
            self.num_kv_held -= 1


class WorkerLease:
    """One in-flight request counted on a worker (``Worker.lease``), given back once.

    A class, not a generator context manager: a stream holds its lease for its whole life,
    and a suspended generator (and the exit stack that held it) weighed about 1 KiB a stream."""

    __slots__ = ("_held", "worker")

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._held = False

    def hold(self) -> WorkerLease:
        if not self._held:
            self._held = True
            self.worker.num_outstanding += 1
        return self

    def release(self) -> None:
        """Idempotent: only a held lease gives its count back."""
        if self._held:
            self._held = False
            self.worker.num_outstanding -= 1

    def __enter__(self) -> Worker:
        self.hold()
        return self.worker

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def mean_kv_usage(workers: Iterable[Worker]) -> float | None:
    """The mean KV-cache usage of the workers in rotation whose usage is known; None if none."""
    known = [w.kv_usage for w in workers if w.in_rotation and w.kv_usage is not None]
    return sum(known) / len(known) if known else None


def least_loaded(workers: Iterable[Worker], kv_watermark: float | None = None) -> Worker | None:
    """The worker in rotation with the fewest outstanding requests (first listed wins ties); with
    ``kv_watermark``, the least-loaded one among those that are not ``kv_full`` at it.

    If every healthy worker is KV-full, the least-loaded of them all: a request gets here only
    after admission, which it passed while some worker had room, and failing it now would lose
    accepted work. Admission's capacity already holds new requests back while all are full,
    and vLLM copes with one more by preempting (slower, not failed).
    """
    best: Worker | None = None
    best_full: Worker | None = None
    for worker in workers:
        if not worker.in_rotation:
            continue
        if kv_watermark is not None and worker.kv_full(kv_watermark):
            if best_full is None or worker.num_outstanding < best_full.num_outstanding:
                best_full = worker
        elif best is None or worker.num_outstanding < best.num_outstanding:
            best = worker
    return best if best is not None else best_full


class WorkerSource(Protocol):
    """A pool as the router sees it: its workers, its KV watermark, and a pick among the
    healthy ones."""

    @property
    def workers(self) -> Sequence[Worker]: ...

    @property
    def kv_watermark(self) -> float:
        """KV-cache usage (0..1) at which a worker counts as full (``Worker.kv_full``): no new
        requests are admitted for it, and ``pick`` passes it over while another has room."""
        ...

    def pick(self) -> Worker | None: ...


def pick_by_affinity(workers: Iterable[Worker], key: str, max_extra_load: int) -> Worker | None:
    """The worker in rotation that ``key`` hashes to, unless it is busier than the least-loaded one
    by more than ``max_extra_load`` requests; then the least-loaded one.

    Rendezvous hashing: each key prefers one worker, and when workers come or go only the keys
    of those workers move, so requests sharing a prompt prefix keep finding the worker whose
    prefix cache already holds it. KV usage plays no part: this picks prefill workers, whose
    usage nobody polls (``Worker.kv_usage`` stays None).
    """
    serving = [worker for worker in workers if worker.in_rotation]
    least = least_loaded(serving)
    if least is None:
        return None
    preferred = max(serving, key=lambda worker: _rendezvous_score(key, worker.name))
    if preferred.num_outstanding - least.num_outstanding > max_extra_load:
        return least
    return preferred


def _rendezvous_score(key: str, name: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
