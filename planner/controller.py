"""The planner of one version at work: every interval, read the load, take a step, carry out
what changed. One owner per version's pools (in the gateway, ``gateway/planning.py``: each
gateway for the pools it runs in a dry run, the holder of the planner's lease on Kubernetes; the
simulator drives ``loop.Planner`` directly).

A failure to read the load or the pools skips the step (no decision on no evidence;
``last_error`` says why until a step succeeds); an actuator that refuses leaves the pool as it
is and the next step asks again. The latest steps are kept (``history``), and apart from them the
latest changes (``changes``: a dry run's or a paused planner's change asked again step after
step is kept once), each with its reason, for ``tandem planner status``, ``/metrics`` and the
audit log.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from planner.actuate import Actuator, ActuatorError, PoolName
from planner.loop import Observation, Planner
from planner.replicas import Load, Observed
from planner.scaling import Decision

log = logging.getLogger("tandem.planner")


class LoadUnavailable(Exception):
    """The metrics could not be read; the message says which and why."""


class LoadSource(Protocol):
    async def interval(self, version: str, window_s: float) -> tuple[Load, Observed]:
        """The version's load and mean latencies over the last ``window_s`` seconds."""
        ...


@dataclass(frozen=True, slots=True)
class Applied:
    """One pool's decision at one step, and whether it was carried out."""

    at: float
    pool: PoolName
    decision: Decision
    error: str | None = None


class PlannerController:
    def __init__(
        self,
        version: str,
        planner: Planner,
        source: LoadSource,
        actuator: Actuator,
        clock: Callable[[], float],
        history: int = 200,
        changes: int = 50,
    ) -> None:
        self.version = version
        self._planner = planner
        self._source = source
        self._actuator = actuator
        self._clock = clock
        self.history: deque[Applied] = deque(maxlen=history)
        self.changes: deque[Applied] = deque(maxlen=changes)
        """Decisions that changed a pool's size (or would have), oldest first."""
        self.last_error: str | None = None
        """Why the latest step was skipped (the load or the pools unreadable); None after a
        step that was taken."""

    async def run_once(self) -> list[Applied]:
        """One step; the decisions taken (none when the load could not be read)."""
        try:
            load, latency = await self._source.interval(self.version, self._planner.interval_s)
            prefill = await self._actuator.state(self.version, "prefill")
            decode = await self._actuator.state(self.version, "decode")
        except (LoadUnavailable, ActuatorError) as exc:
            log.warning("planner %s: no step this interval: %s", self.version, exc)
            self.last_error = str(exc)
            return []
        self.last_error = None
        now = self._clock()
        step = self._planner.step(now, Observation(load, latency, prefill, decode))
        applied = [
            await self._apply(now, "prefill", step.prefill),
            await self._apply(now, "decode", step.decode),
        ]
        self.history.extend(applied)
        for done in applied:
            if done.decision.changes and not self._repeats(done):
                self.changes.append(done)
        return applied

    def _repeats(self, done: Applied) -> bool:
        """Whether ``done`` asks what the pool's latest change asked, with the same outcome."""
        last = next((c for c in reversed(self.changes) if c.pool == done.pool), None)
        return last is not None and (last.decision.current, last.decision.desired, last.error) == (
            done.decision.current,
            done.decision.desired,
            done.error,
        )

    async def _apply(self, now: float, pool: PoolName, decision: Decision) -> Applied:
        if not decision.changes:
            return Applied(now, pool, decision)
        try:
            await self._actuator.scale(self.version, pool, decision.desired, decision.reason)
        except ActuatorError as exc:
            log.warning("planner %s: %s not scaled to %d: %s", self.version, pool,
                        decision.desired, exc)  # fmt: skip
            return Applied(now, pool, decision, str(exc))
        # Debug: each actuator logs what it did (launched, patched, or nothing: dry run, paused).
        log.debug("planner %s: asked %s %d -> %d (%s)", self.version, pool, decision.current,
                  decision.desired, decision.reason)  # fmt: skip
        return Applied(now, pool, decision)
