"""The autoscaling planner at work in the gateway: every ``interval_s``, one step of each
deployed version's ``PlannerController`` (``planner/controller.py``) over the load in this
gateway's per-version windows (``planner/windows_source.py``).

- **Modes.** ``dry-run``: each pool is read as it is (healthy workers serving, the others
  starting) and nothing is changed; every gateway plans the pools it runs, no lease.
  ``local``: the pools' workers are this gateway's own processes, started and drained by
  ``gateway/local_actuator.py`` (one gateway owns them: no lease).
  ``kubernetes``: the versions' Deployments are scaled (``planner/kubernetes.py``) by the
  gateway holding the lease named ``planner`` alone. It acquires (or renews) it before each pass
  for three intervals, so a survivor takes over within about that of a holder's death. A
  gateway that does not hold it keeps no planners: one that takes over starts afresh, as a
  restarted planner does (no shrinking before a whole down-window of load is seen).
- **Versions.** A version's controller is made when the version first appears among the
  deployments and dropped when it is undeployed.
- **Decisions.** Every step sets ``tandem_planner_current_replicas`` and ``..._desired_...``. A
  decision that changes a pool is counted (``tandem_planner_decisions_total``, ``up`` or
  ``down``) and audited (actor ``planner``, action ``pool.scale``: replicas before and after,
  the reason) once: until the pool reaches that size or the planner asks for another. A dry
  run's pools never move, and its planner would otherwise say the same every step.
- **Pause.** ``pause`` keeps the planner stepping and reporting while it changes nothing (a
  dry run of the same mode), until ``resume``: an operator's hold during an incident or a
  test. It is this gateway's; ``TANDEM_PLANNER_PAUSED`` starts it paused.
- **Wake.** A request that finds its version with no decode worker asks ``wake``: when the
  local actuator can bring one (a pool scaled to zero, or one it is booting), the next pass
  runs at once and the request waits in the admission queue, with heartbeats, instead of a 503.
- **Failures.** A step that cannot read the load or the pools, an actuator that refuses, and a
  bug in one version's step are logged and counted (``tandem_planner_step_errors_total``); the
  other versions still step, and the next pass tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from admission.quota import StoreUnavailable
from gateway.audited import audit
from gateway.local_actuator import WorkerBudget, pool_workers, serving_state, staying_workers
from gateway.metrics import GatewayMetrics
from planner.actuate import Actuator, DryRunActuator, PoolName
from planner.controller import Applied, LoadSource, PlannerController
from planner.loop import Planner, PoolState
from planner.profile import Profile
from planner.replicas import Targets
from planner.scaling import ScalingPolicy
from rollouts.lease import Lease
from versions.store import VersionStore
from workers.deployments import Deployments

log = logging.getLogger("tandem.planner")

PlannerMode = Literal["off", "dry-run", "local", "kubernetes"]
PLANNER_ACTOR = "planner"
"""The audit log's actor of the planner's decisions."""
LEASE_NAME = "planner"
POOLS: tuple[PoolName, ...] = ("prefill", "decode")
_SHOWN_DECISIONS = 10
"""Decisions per pool in the status, newest first."""
_LEASE_INTERVALS = 3
"""The lease lasts this many intervals: a holder renews it at every pass."""


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The planner the gateway runs (``TANDEM_PLANNER*``)."""

    mode: PlannerMode = "off"
    profile: Profile | None = None
    """The worker profile every version's pools are sized by; required unless ``off``."""
    interval_s: float = 30.0
    """Between two passes; each reads the load of the last interval."""
    targets: Targets = field(default_factory=lambda: Targets(ttft_s=1.0, itl_s=0.1))
    """Mean TTFT and ITL the pools are sized for, and the share of a worker's profile used."""
    prefill: ScalingPolicy = field(
        default_factory=lambda: ScalingPolicy(min_replicas=0, max_replicas=8)
    )
    decode: ScalingPolicy = field(
        default_factory=lambda: ScalingPolicy(min_replicas=1, max_replicas=8)
    )
    namespace: str = "default"
    """The Kubernetes namespace of the versions' Deployments (``kubernetes`` mode)."""
    budget: WorkerBudget = field(default_factory=WorkerBudget)
    """What the local actuator may run on this host (``local`` mode)."""
    drain_timeout_s: float = 120.0
    """How long a worker being removed may finish its requests (``local`` mode)."""
    paused: bool = False
    """Start paused: stepping and reporting, changing nothing until resumed."""

    def __post_init__(self) -> None:
        if self.mode != "off" and self.profile is None:
            raise ValueError(f"planner mode {self.mode!r} needs a worker profile")
        if self.interval_s <= 0:
            raise ValueError(f"planner interval_s must be more than 0, not {self.interval_s}")


def pool_state(deployments: Deployments, version: str, pool: PoolName) -> PoolState:
    """A deployed version's pool as the gateway sees it: healthy workers serve, the others are
    starting (booting, or restarting after a crash)."""
    return serving_state(staying_workers(deployments, version, pool))


def dry_run_actuator(deployments: Deployments) -> DryRunActuator:
    """Reads the pools' real workers; scales nothing."""
    return DryRunActuator(observe=functools.partial(pool_state, deployments))


class _Watched:
    """An ``Actuator`` that remembers the pools it last read, for the status, and carries
    nothing out while paused."""

    def __init__(self, actuator: Actuator, paused: bool) -> None:
        self._actuator = actuator
        self.paused = paused
        self.seen: dict[tuple[str, PoolName], PoolState] = {}

    async def state(self, version: str, pool: PoolName) -> PoolState:
        state = await self._actuator.state(version, pool)
        self.seen[(version, pool)] = state
        return state

    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        if self.paused:
            log.info("planner (paused): %s %s -> %d workers: %s", version, pool, replicas, reason)
            return
        await self._actuator.scale(version, pool, replicas, reason)


@dataclass(slots=True)
class _Version:
    """One deployed version's planner and what this gateway recorded of it."""

    alias: str
    controller: PlannerController
    recorded: dict[PoolName, tuple[int, int, bool]] = field(default_factory=dict)
    """Per pool, the change last counted and audited (current, desired, while paused), until
    reached."""
    failure: str | None = None
    """Why its latest step failed; None after one that did not."""


class GatewayPlanner:
    """Plans every deployed version's pools. ``start`` it with the app, ``aclose`` it on the
    way out (it stops between passes or cancels the one running)."""

    def __init__(
        self,
        config: PlannerConfig,
        deployments: Deployments,
        source: LoadSource,
        actuator: Actuator,
        metrics: GatewayMetrics,
        *,
        audit_store: VersionStore | None,
        lease: Lease | None = None,
        holder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        decode_coming: Callable[[str], bool] | None = None,
    ) -> None:
        """``lease``: only its holder acts (None: this gateway always does, as in a dry run).
        ``clock``: the scaling windows' time (monotonic). ``decode_coming(version)``: whether
        the actuator has a decode worker of ``version`` on its way or can start one (``wake``;
        None: it never can)."""
        if config.profile is None:
            raise ValueError("the planner needs a worker profile")
        self.config = config
        self._profile = config.profile
        self._deployments = deployments
        self._source = source
        self._actuator = _Watched(actuator, config.paused)
        self._decode_coming = decode_coming
        self._woken = asyncio.Event()
        self._metrics = metrics
        self._audit_store = audit_store
        self._lease = lease
        self.holder = holder or f"gw-{secrets.token_hex(4)}"
        self._clock = clock
        self._versions: dict[str, _Version] = {}
        self._holding = lease is None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="tandem-planner")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease is not None and self._holding:
            with contextlib.suppress(StoreUnavailable):
                await self._lease.release(self.holder)
            self._holding = False

    @property
    def paused(self) -> bool:
        return self._actuator.paused

    def pause(self) -> None:
        """Go on stepping and reporting; change nothing until ``resume``."""
        self._actuator.paused = True

    def resume(self) -> None:
        self._actuator.paused = False

    def can_wake(self, version: str) -> bool:
        """Whether a decode worker of ``version`` is on its way, or would be started for a
        request (a pool the planner scaled to zero)."""
        return not (
            self.paused
            or self._decode_coming is None
            or self.config.decode.max_replicas == 0
            or not self._decode_coming(version)
        )

    def wake(self, version: str) -> bool:
        """A request found ``version`` without a decode worker: True when one is on its way
        (the next pass runs now to start it if need be), so the request may wait for it."""
        if not self.can_wake(version):
            return False
        self._woken.set()
        return True

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.config.interval_s)
            self._woken.clear()
            try:
                await self.run_once()
            except Exception:
                # The loop outlives any one pass's failure: a planner that stopped would leave
                # the pools at whatever size they had, silently.
                log.exception("planner pass failed; the next one tries again")

    async def run_once(self) -> None:
        """One pass: a step of every deployed version's planner, if this gateway may act."""
        if not await self._may_act():
            return
        deployed = {deployment.version: deployment for deployment in self._deployments}
        for version in [v for v in self._versions if v not in deployed]:
            self._forget(version)
        for version, deployment in deployed.items():
            planned = self._versions.get(version)
            if planned is None:
                planned = self._versions[version] = self._plan(version, deployment.model.name)
            try:
                failure = await self._step(version, planned)
            except Exception as exc:
                # One version's failure (a bug, an audit store gone) must not stop the others.
                log.exception("planner %s: the step failed; the next one tries again", version)
                failure = f"{type(exc).__name__}: {exc}"
            planned.failure = failure
            if failure is not None:
                self._metrics.observe_planner_step_error(version)

    def status(self) -> dict[str, Any]:
        """What ``GET /admin/v1/planner`` shows: the settings, and per version and pool the
        workers last read, the size wanted, the limits, the latest decisions."""
        config = self.config
        to_unix = time.time() - self._clock()
        return {
            "mode": config.mode,
            "paused": self.paused,
            "interval_s": config.interval_s,
            "targets": {
                "ttft_s": config.targets.ttft_s,
                "itl_s": config.targets.itl_s,
                "headroom": config.targets.headroom,
                "kv_usage": config.targets.kv_usage,
            },
            "profile": self._profile.version,
            "lease": None
            if self._lease is None
            else {"name": LEASE_NAME, "holder": self.holder, "held": self._holding},
            "versions": [
                self._version_status(version, planned, to_unix)
                for version, planned in sorted(self._versions.items())
            ],
        }

    def _plan(self, version: str, alias: str) -> _Version:
        config = self.config
        if self._profile.version != version:
            log.warning(
                "planner: sizing %s by the profile of %s (one profile serves every version; "
                "measure this one with `tandem profile --version %s`)",
                version, self._profile.version, version,
            )  # fmt: skip
        planner = Planner(
            self._profile, config.targets, config.interval_s, config.prefill, config.decode
        )
        controller = PlannerController(
            version, planner, self._source, self._actuator, clock=self._clock
        )
        return _Version(alias, controller)

    async def _step(self, version: str, planned: _Version) -> str | None:
        """Run one step and record its decisions; why it failed, or None."""
        controller = planned.controller
        applied = await controller.run_once()
        if controller.last_error is not None:
            return controller.last_error
        refused = []
        for done in applied:
            decision = done.decision
            self._metrics.observe_planner_pool(
                version, done.pool, decision.current, decision.desired
            )
            recorded = planned.recorded.get(done.pool)
            if recorded is not None and decision.current == recorded[1]:
                del planned.recorded[done.pool]  # reached: the same change later is a new one
                recorded = None
            if done.error is not None:
                refused.append(f"{done.pool}: {done.error}")
            elif decision.changes and recorded != (
                decision.current,
                decision.desired,
                self.paused,
            ):  # a change held while paused and carried out once resumed is recorded again
                planned.recorded[done.pool] = (decision.current, decision.desired, self.paused)
                direction = "up" if decision.desired > decision.current else "down"
                self._metrics.observe_planner_decision(version, done.pool, direction)
                await self._audit(version, planned.alias, done)
        return "; ".join(refused) or None

    async def _audit(self, version: str, alias: str, done: Applied) -> None:
        if self._audit_store is None:
            return
        decision = done.decision
        try:
            await audit(
                self._audit_store,
                "pool.scale",
                actor=PLANNER_ACTOR,
                alias=alias,
                subject=version,
                before={"pool": done.pool, "replicas": decision.current},
                after={
                    "pool": done.pool,
                    "replicas": decision.desired,
                    "recommended": decision.recommended,
                    "dry_run": self.config.mode == "dry-run" or self.paused,
                },
                reason=decision.reason,
            )
        except StoreUnavailable as exc:
            # The decision stands (it was carried out); the log says what the audit missed.
            log.warning(
                "planner %s: %s %d -> %d not audited: %s", version, done.pool,
                decision.current, decision.desired, exc,
            )  # fmt: skip

    async def _may_act(self) -> bool:
        """Whether this gateway plans now: always without a lease, else while it holds it."""
        if self._lease is None:
            return True
        ttl_s = _LEASE_INTERVALS * self.config.interval_s
        try:
            holding = await self._lease.acquire(self.holder, ttl_s) is not None
        except StoreUnavailable as exc:
            log.warning("planner lease unreachable (%s); no planning this interval", exc)
            holding = False
        if holding != self._holding:
            log.info(
                "planner: %s %s", self.holder,
                "plans the pools" if holding else "no longer plans the pools",
            )  # fmt: skip
        self._holding = holding
        if not holding:
            for version in list(self._versions):
                self._forget(version)
        return holding

    def _forget(self, version: str) -> None:
        del self._versions[version]
        for pool in POOLS:
            self._actuator.seen.pop((version, pool), None)
        self._metrics.forget_planner_version(version)

    def _draining(self, version: str, pool: PoolName) -> int:
        """The pool's workers leaving now (a scale-down's drains)."""
        deployment = self._deployments.get(version)
        if deployment is None:
            return 0
        return sum(1 for worker in pool_workers(deployment, pool) if worker.draining)

    def _version_status(self, version: str, planned: _Version, to_unix: float) -> dict[str, Any]:
        history = list(planned.controller.history)
        pools = {}
        for pool in POOLS:
            policy = self.config.prefill if pool == "prefill" else self.config.decode
            steps = [done for done in history if done.pool == pool]
            seen = self._actuator.seen.get((version, pool))
            changes = [done for done in reversed(planned.controller.changes) if done.pool == pool]
            pools[pool] = {
                "ready": None if seen is None else seen.ready,
                "starting": None if seen is None else seen.starting,
                "kv_usage": None if seen is None else seen.kv_usage,
                "draining": self._draining(version, pool),
                "desired": steps[-1].decision.desired if steps else None,
                "min_replicas": policy.min_replicas,
                "max_replicas": policy.max_replicas,
                "last": _applied_json(steps[-1], to_unix) if steps else None,
                "decisions": [_applied_json(d, to_unix) for d in changes[:_SHOWN_DECISIONS]],
            }
        return {
            "version": version,
            "alias": planned.alias,
            "error": planned.failure,
            "pools": pools,
        }


def off_status() -> dict[str, Any]:
    """The status of a gateway whose planner is off."""
    return {"mode": "off", "versions": []}


def _applied_json(done: Applied, to_unix: float) -> dict[str, Any]:
    decision = done.decision
    return {
        "at": done.at + to_unix,
        "current": decision.current,
        "recommended": decision.recommended,
        "desired": decision.desired,
        "reason": decision.reason,
        "error": done.error,
    }
