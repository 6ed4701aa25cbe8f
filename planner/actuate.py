"""Where scaling decisions are carried out: an ``Actuator`` per deployment target.

- local: starts and drains ``tandem up``'s vLLM worker processes through the gateway's
  supervisor (``gateway/local_actuator.py``: it needs the gateway's workers, so it lives there);
- ``kubernetes``: patches the ``scale`` subresource of a version's prefill and decode
  Deployments (``planner/kubernetes.py``);
- ``DryRunActuator``: carries nothing out; it keeps the latest decisions, for the logs and
  trying the planner on live traffic first (the gateway's dry run reads the pools' real workers
  through ``observe``).

An actuator is told the size a pool should have, never how to get there; it reports the
pool's size (serving and starting) back to the planner on the next step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from planner.loop import PoolState

log = logging.getLogger("tandem.planner")

PoolName = Literal["prefill", "decode"]


class ActuatorError(Exception):
    """The target refused or could not be reached; the message says which and why. The
    planner keeps the pool as it is and tries again next step."""


class Actuator(Protocol):
    async def state(self, version: str, pool: PoolName) -> PoolState:
        """The pool's workers now: serving, and starting."""
        ...

    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        """Ask for ``replicas`` workers in the pool (``reason``: the planner's decision)."""
        ...


@dataclass(frozen=True, slots=True)
class Requested:
    version: str
    pool: PoolName
    replicas: int
    reason: str


MAX_REQUESTED = 1000
"""Requests a dry run keeps (the newest): it runs for as long as the gateway does."""


@dataclass
class DryRunActuator:
    """Pools stay as they are; every request is logged and kept (``requested``)."""

    sizes: dict[tuple[str, PoolName], int] = field(default_factory=dict)
    """The pools' real sizes, as the caller knows them (a missing pool reads as 0)."""
    requested: deque[Requested] = field(default_factory=lambda: deque(maxlen=MAX_REQUESTED))
    """The newest ``MAX_REQUESTED`` requests, oldest first."""
    observe: Callable[[str, PoolName], PoolState] | None = None
    """Reads a pool's workers as they are (the gateway's deployments: healthy ones serving,
    the others starting); None: ``sizes``. It may raise ``ActuatorError``."""

    async def state(self, version: str, pool: PoolName) -> PoolState:
        if self.observe is not None:
            return self.observe(version, pool)
        return PoolState(self.sizes.get((version, pool), 0))

    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        self.requested.append(Requested(version, pool, replicas, reason))
        log.info("planner (dry run): %s %s -> %d workers: %s", version, pool, replicas, reason)
