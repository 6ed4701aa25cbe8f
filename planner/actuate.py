"""Where scaling decisions are carried out: an ``Actuator`` per deployment target.

- local (to come): starts and drains vLLM worker processes through the gateway's supervisor;
- ``kubernetes``: patches the ``scale`` subresource of a version's prefill and decode
  Deployments (``planner/kubernetes.py``);
- ``DryRunActuator``: carries nothing out; it keeps the decisions, for the logs, ``/metrics``
  and trying the planner on live traffic first.

An actuator is told the size a pool should have, never how to get there; it reports the
pool's size (serving and starting) back to the planner on the next step.
"""

from __future__ import annotations

import logging
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


@dataclass
class DryRunActuator:
    """Pools stay as they are; every request is logged and kept (``requested``)."""

    sizes: dict[tuple[str, PoolName], int] = field(default_factory=dict)
    """The pools' real sizes, as the caller knows them (a missing pool reads as 0)."""
    requested: list[Requested] = field(default_factory=list)

    async def state(self, version: str, pool: PoolName) -> PoolState:
        return PoolState(self.sizes.get((version, pool), 0))

    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        self.requested.append(Requested(version, pool, replicas, reason))
        log.info("planner (dry run): %s %s -> %d workers: %s", version, pool, replicas, reason)
