"""The planner's local actuator: ``tandem up``'s own vLLM workers, started and drained on this
host (``TANDEM_PLANNER=local``, the embedded default's way to autoscale).

- **Up:** one worker is launched per missing replica, within the host's ``WorkerBudget``
  (worker processes and memory); past it the actuator launches what fits and refuses the rest,
  saying which limit. A launched worker counts as starting until its health check passes.
- **Down:** the workers to remove are chosen among those this gateway launched (external ones
  are someone else's): first any not serving yet, then the least busy, then the newest. Each
  leaves rotation at once and drains in the background (``WorkerPool.drain``): its streams
  finish, decode legs read the KV it holds, then it stops; at ``drain_timeout_s`` what is left
  is cut (streams end with an error event, decode legs re-run colocated).
- **State:** a pool is its workers that are not leaving: healthy ones serve, the others start.
- **Zero:** ``decode_coming`` tells the router whether a request that found no decode worker
  should wait in the queue: yes while one the planner launched boots, or when the pool is empty
  and one can be launched (the planner is then woken to do it).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from core.messages import WorkerRole
from gateway.catalog import DeployError
from planner.actuate import ActuatorError, PoolName
from planner.loop import PoolState
from workers.deployments import Deployment, Deployments
from workers.pool import Drained
from workers.registry import Worker, mean_kv_usage

log = logging.getLogger("tandem.planner")

_ROLES: dict[PoolName, WorkerRole] = {"prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE}


class WorkerLauncher(Protocol):
    """What the local actuator needs of the gateway's supervisor."""

    def can_add(self, version: str) -> bool: ...

    def managed(self, version: str, role: WorkerRole) -> set[str]:
        """Names of the workers of ``version``'s ``role`` pool this gateway launched."""
        ...

    def num_managed(self) -> int: ...

    async def add_worker(self, version: str, role: WorkerRole) -> Worker: ...

    async def drain_worker(
        self, version: str, role: WorkerRole, name: str, timeout_s: float
    ) -> Drained: ...


@dataclass(frozen=True, slots=True)
class WorkerBudget:
    """What the local actuator may run on this host, every version and pool together."""

    max_workers: int | None = None
    """Worker processes at most (draining ones count until they stop); None: no cap."""
    memory_gib: float | None = None
    """Memory the workers may take; None: no cap."""
    worker_memory_gib: float = 4.0
    """What one worker takes (weights, KV cache, the runtime: ~3.7 GB for the bundled model
    with a 1 GiB KV cache on CPU)."""

    def __post_init__(self) -> None:
        if self.max_workers is not None and self.max_workers < 0:
            raise ValueError(f"max_workers cannot be negative, not {self.max_workers}")
        if self.worker_memory_gib <= 0:
            raise ValueError(f"worker_memory_gib must be positive, not {self.worker_memory_gib}")

    def room(self, running: int) -> int:
        """Workers that may still be launched beside ``running`` ones."""
        caps = []
        if self.max_workers is not None:
            caps.append(self.max_workers)
        if self.memory_gib is not None:
            caps.append(int(self.memory_gib // self.worker_memory_gib))
        return max(0, min(caps) - running) if caps else 1 << 30

    def describe(self) -> str:
        parts = []
        if self.max_workers is not None:
            parts.append(f"{self.max_workers} workers (TANDEM_PLANNER_MAX_WORKERS)")
        if self.memory_gib is not None:
            parts.append(
                f"{self.memory_gib:g} GiB at {self.worker_memory_gib:g} GiB a worker "
                "(TANDEM_PLANNER_MEMORY_GIB, TANDEM_PLANNER_WORKER_MEMORY_GIB)"
            )
        return " and ".join(parts) or "no limit"


def host_memory_gib() -> float | None:
    """This host's physical memory; None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return None


def pool_workers(deployment: Deployment, pool: PoolName) -> Sequence[Worker]:
    """Every worker of the deployment's ``pool``, draining ones included."""
    return (deployment.prefill if pool == "prefill" else deployment.decode).workers


def staying_workers(deployments: Deployments, version: str, pool: PoolName) -> list[Worker]:
    """The workers of ``version``'s pool that are not leaving (draining ones are not counted:
    they are on their way out); ``ActuatorError`` when the version is not deployed here."""
    deployment = deployments.get(version)
    if deployment is None:
        raise ActuatorError(f"{version} is not deployed on this gateway")
    return [worker for worker in pool_workers(deployment, pool) if not worker.draining]


def serving_state(workers: list[Worker]) -> PoolState:
    """A pool's workers as the planner reads them: healthy ones serve, the others start."""
    ready = sum(1 for worker in workers if worker.healthy)
    return PoolState(ready, len(workers) - ready, mean_kv_usage(workers))


class LocalActuator:
    """``Actuator`` over this gateway's supervisor (module docstring). ``aclose`` it before the
    supervisor: drains still running are cancelled and their workers stop with the pools."""

    def __init__(
        self,
        launcher: WorkerLauncher,
        deployments: Deployments,
        budget: WorkerBudget,
        drain_timeout_s: float,
        on_drained: Callable[[str, PoolName, Drained], None] = lambda *_: None,
        on_added: Callable[[str, Worker, str | None], None] = lambda *_: None,
    ) -> None:
        """``on_drained(version, pool, how)``: a worker drained and stopped;
        ``on_added(version, worker, sibling)``: a worker launched in the pool of worker
        ``sibling`` (to price it alike; None: the pool had no other)."""
        self._launcher = launcher
        self._deployments = deployments
        self.budget = budget
        self.drain_timeout_s = drain_timeout_s
        self._on_drained = on_drained
        self._on_added = on_added
        self._drains: set[asyncio.Task[None]] = set()
        self._booting: set[str] = set()
        """Workers this actuator launched that have not been healthy yet."""

    async def state(self, version: str, pool: PoolName) -> PoolState:
        workers = self._staying(version, pool)
        self._booting.difference_update(worker.name for worker in workers if worker.healthy)
        return serving_state(workers)

    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        role = _ROLES[pool]
        if not self._launcher.can_add(version):
            raise ActuatorError(
                f"{version}'s workers are external: the local actuator starts and stops only "
                "workers tandem up launched"
            )
        staying = self._staying(version, pool)
        if replicas > len(staying):
            await self._add(version, pool, role, replicas - len(staying))
        elif replicas < len(staying):
            self._remove(version, pool, role, staying, len(staying) - replicas, reason)

    def decode_coming(self, version: str) -> bool:
        """Whether a decode worker of ``version`` is on its way, or could be launched now for
        a pool that has none (module docstring)."""
        if not self._launcher.can_add(version) or self._deployments.get(version) is None:
            return False
        staying = self._staying(version, "decode")
        if not staying:
            return self.budget.room(self._launcher.num_managed()) > 0
        return any(w.name in self._booting and not w.healthy for w in staying)

    async def aclose(self) -> None:
        for task in list(self._drains):
            task.cancel()
        await asyncio.gather(*self._drains, return_exceptions=True)

    def _staying(self, version: str, pool: PoolName) -> list[Worker]:
        return staying_workers(self._deployments, version, pool)

    async def _add(self, version: str, pool: PoolName, role: WorkerRole, wanted: int) -> None:
        room = self.budget.room(self._launcher.num_managed())
        managed = self._launcher.managed(version, role)
        sibling = next(iter(sorted(managed)), None)
        for _ in range(min(wanted, room)):
            try:
                worker = await self._launcher.add_worker(version, role)
            except (DeployError, OSError) as exc:
                raise ActuatorError(f"could not launch a {pool} worker: {exc}") from exc
            self._booting.add(worker.name)
            self._on_added(version, worker, sibling)
            log.info("planner: launched %s for %s (%s pool)", worker.name, version, pool)
        if room < wanted:
            raise ActuatorError(
                f"the host's worker budget ({self.budget.describe()}) allows {room} more of "
                f"the {wanted} {pool} workers wanted"
            )

    def _remove(
        self,
        version: str,
        pool: PoolName,
        role: WorkerRole,
        staying: list[Worker],
        count: int,
        reason: str,
    ) -> None:
        managed = self._launcher.managed(version, role)
        # Not serving yet first (nothing to drain), then the least busy (the shortest drain),
        # then the newest (the oldest have the warmest prefix caches).
        order = {worker.name: i for i, worker in enumerate(staying)}
        candidates = sorted(
            (w for w in staying if w.name in managed),
            key=lambda w: (w.healthy, w.num_outstanding + w.num_kv_held, -order[w.name]),
        )
        for worker in candidates[:count]:
            worker.draining = True  # out of rotation now, not when the task first runs
            self._booting.discard(worker.name)
            log.info("planner: draining %s of %s (%s pool): %s", worker.name, version, pool,
                     reason)  # fmt: skip
            task = asyncio.create_task(
                self._drain(version, pool, role, worker.name), name=f"drain {worker.name}"
            )
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)
        if len(candidates) < count:
            raise ActuatorError(
                f"{count - len(candidates)} of the {count} {pool} workers to remove are not "
                "ones tandem up launched"
            )

    async def _drain(self, version: str, pool: PoolName, role: WorkerRole, name: str) -> None:
        try:
            drained = await self._launcher.drain_worker(version, role, name, self.drain_timeout_s)
            self._on_drained(version, pool, drained)
        except (DeployError, ValueError) as exc:  # undeployed meanwhile: its pools are gone
            log.warning("planner: drain of %s ended early: %s", name, exc)
        except Exception:
            # A task nobody awaits: its failure must reach the log.
            log.exception("planner: drain of %s failed", name)
