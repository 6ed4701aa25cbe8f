"""The rollout controller: the one owner of every rollout's progress.

Every gateway runs one; the one holding the lease (``rollouts.lease``, a fencing token) acts,
the others wait to take over. A new holder first raises the store's fence to its token
(``RolloutStore.advance_fence``), so the previous holder's saves are refused from then on. Each
``tick_s`` the holder walks the active rollouts and, for each:

1. applies the operator commands queued since the last pass (``pause``, ``resume``,
   ``promote``, ``abort``, pushed by the admin API of any gateway);
2. runs what the phase needs: the quality check (in a task of its own, so a slow one never
   delays another rollout's rollback), or a round of gate measurements when one is due;
3. saves the rollout with its fencing token: a gateway that lost the lease without knowing it
   is refused there (``FencedOutError``) and stops before it changes any traffic;
4. puts the traffic policy the rollout wants in force (through ``TrafficControl``, which audits
   it); every replica polls the policy revision, so a rollback reaches all of them within the
   catalog's refresh interval (0.5 s by default);
5. audits each new decision and sends its webhook; after the grace period, drains the baseline;
   when the rollout ends, writes its report.

A policy that could not be put (a store outage, a crash between the save and the put) is put on
the next pass: ``policy_applied`` stays False until it is. Decisions are announced at least once
(a crash after announcing and before saving repeats them); a webhook's delivery id
(``<rollout>-<decision index>``) lets a receiver drop repeats.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from admission.quota import StoreUnavailable
from rollouts import machine
from rollouts.gates import Measurement, VersionFigures, measure
from rollouts.lease import Lease
from rollouts.provider import MetricsProvider, MetricsUnavailable
from rollouts.quality import Completer, QualityResult, run_check
from rollouts.record import Phase, Rollout, Status
from rollouts.report import ReportData, write_report
from rollouts.store import FencedOutError, RolloutStore
from rollouts.webhook import WebhookEvent, WebhookSender

log = logging.getLogger("tandem.rollouts")

WEBHOOK_EVENTS = frozenset(
    {
        "started",
        "step_passed",
        "failed",
        "rolled_back",
        "promoted",
        "paused",
        "resumed",
        "aborted",
        "succeeded",
    }
)
_FINISHED_SCAN_S = 5.0


class TrafficControl(Protocol):
    """What the controller changes outside the rollout store (the gateway implements it with
    the version store, the audit log and its deployer)."""

    async def policy(self, alias: str) -> dict[str, Any] | None:
        """The alias's traffic policy as stored."""
        ...

    async def put_policy(
        self, alias: str, policy: dict[str, Any], *, actor: str, reason: str
    ) -> None:
        """Put ``policy`` in force for ``alias`` (validated, audited)."""
        ...

    async def drain(self, version: str, *, actor: str, reason: str) -> None:
        """Stop serving ``version`` and undeploy it (audited); nothing if not deployed."""
        ...

    async def audit(
        self,
        action: str,
        *,
        alias: str,
        subject: str,
        after: dict[str, Any],
        actor: str,
        reason: str,
    ) -> None:
        """Append an audit entry."""
        ...


class RolloutController:
    """See the module docstring. ``start`` it with the app, ``aclose`` it on the way out."""

    def __init__(
        self,
        store: RolloutStore,
        lease: Lease,
        provider: MetricsProvider,
        traffic: TrafficControl,
        completer: Completer,
        *,
        webhooks: WebhookSender | None = None,
        reports_dir: Path | None = None,
        holder: str | None = None,
        tick_s: float = 0.25,
        lease_ttl_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``lease_ttl_s``: how long a holder that stopped renewing keeps the lease (another
        gateway takes over within that and one renewal interval, ``lease_ttl_s / 3``)."""
        self._store = store
        self._lease = lease
        self._provider = provider
        self._traffic = traffic
        self._completer = completer
        self._webhooks = webhooks
        self._reports_dir = reports_dir
        self.holder = holder or f"gw-{secrets.token_hex(4)}"
        self._tick_s = tick_s
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._token: int | None = None
        self._quality: dict[str, asyncio.Task[QualityResult]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._last_finished_scan = 0.0
        self._failing = False

    @property
    def fence(self) -> int | None:
        """The fencing token while this gateway holds the lease."""
        return self._token

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._hold_lease(), name="tandem-rollout-lease"),
            asyncio.create_task(self._run(), name="tandem-rollouts"),
        ]

    async def aclose(self) -> None:
        for task in [*self._tasks, *self._quality.values()]:
            task.cancel()
        for task in [*self._tasks, *self._quality.values()]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        self._quality.clear()
        if self._token is not None:
            with contextlib.suppress(StoreUnavailable):
                await self._lease.release(self.holder)
            self._token = None

    async def renew_lease(self) -> int | None:
        """Acquire or renew the lease once; the fencing token while held. (The background task
        calls it every ``lease_ttl_s / 3``.)"""
        try:
            token = await self._lease.acquire(self.holder, self._lease_ttl_s)
        except StoreUnavailable as exc:
            # Not renewed: it runs out on its own, and the fence stops a late write.
            log.warning("rollout lease unreachable (%s)", exc)
            token = None
        if token is not None and token != self._token:
            try:
                # Before acting on anything: the previous holder's saves are refused from now.
                await self._store.advance_fence(token)
            except StoreUnavailable as exc:
                log.warning("rollout store unreachable (%s); not acting on the lease yet", exc)
                return None
            log.info("rollouts: %s evaluates them (fence %s)", self.holder, token)
        elif token is None and self._token is not None:
            log.info("rollouts: %s no longer evaluates them", self.holder)
        self._token = token
        return token

    async def _hold_lease(self) -> None:
        while True:
            await self.renew_lease()
            await asyncio.sleep(self._lease_ttl_s / 3)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                await self.run_once()
            except StoreUnavailable as exc:
                if not self._failing:
                    log.warning("rollout store unreachable (%s); rollouts wait", exc)
                self._failing = True
                continue
            except Exception:
                log.exception("rollout pass failed; the next one tries again")
            self._failing = False

    async def run_once(self) -> None:
        """One pass over the active rollouts, if this gateway holds the lease."""
        token = self._token
        if token is None:
            return
        records = await self._store.list(active=True)
        now = self._clock()
        if now - self._last_finished_scan >= _FINISHED_SCAN_S:
            # Ended rollouts whose policy or announcements a crash left half done.
            self._last_finished_scan = now
            records += [
                r
                for r in await self._store.list(active=False, limit=20)
                if not r.get("policy_applied", True) or r.get("announced", 0) < len(r["decisions"])
            ]
        for record in records:
            try:
                await self._evaluate(Rollout.from_dict(record), token)
            except FencedOutError:
                log.warning("rollouts: %s lost the lease (fence %s)", self.holder, token)
                self._token = None
                return

    async def _evaluate(self, rollout: Rollout, token: int) -> None:
        before = rollout.to_dict()
        now = self._clock()
        for seq, command in await self._store.commands(
            rollout.rollout_id, rollout.last_command_seq
        ):
            machine.command(
                rollout,
                str(command.get("action")),
                str(command.get("actor", "")),
                str(command.get("reason", "")),
                now,
            )
            rollout.last_command_seq = seq
        effects = machine.Effects()
        if rollout.status is Status.RUNNING:
            if rollout.phase is Phase.QUALITY:
                self._quality_check(rollout, now)
            elif machine.measurement_due(rollout, now):
                machine.measured(rollout, await self._measure(rollout, now), now)
            effects = machine.tick(rollout, now)
        if not rollout.status.active or rollout.phase is not Phase.QUALITY:
            task = self._quality.pop(rollout.rollout_id, None)
            if task is not None:
                task.cancel()
        before = await self._save_if_changed(rollout, before, token)
        if not rollout.policy_applied:
            existing = await self._traffic.policy(rollout.alias)
            await self._traffic.put_policy(
                rollout.alias,
                machine.desired_policy(rollout, existing),
                actor=machine.CONTROLLER,
                reason=f"rollout {rollout.rollout_id}: {rollout.decisions[-1].event}",
            )
            rollout.policy_applied = True
        if effects.drain_baseline:
            await self._traffic.drain(
                rollout.spec.baseline,
                actor=machine.CONTROLLER,
                reason=f"rollout {rollout.rollout_id} succeeded",
            )
        await self._announce(rollout)
        if not rollout.status.active and not rollout.report and self._reports_dir is not None:
            rollout.report = await self._write_report(rollout, now)
        await self._save_if_changed(rollout, before, token)

    async def _save_if_changed(
        self, rollout: Rollout, before: dict[str, Any], token: int
    ) -> dict[str, Any]:
        """Save ``rollout`` (fenced by ``token``) if it differs from ``before``; what is stored."""
        record = rollout.to_dict()
        if record != before:
            await self._store.save(record, token)
        return record

    def _quality_check(self, rollout: Rollout, now: float) -> None:
        """Start the golden prompts in a task, or take its result; a failed run is retried
        every ``interval_s``."""
        task = self._quality.get(rollout.rollout_id)
        if task is None:
            last = rollout.last_measured_at
            if last is None or now >= last + rollout.spec.interval_s:
                spec = rollout.spec
                self._quality[rollout.rollout_id] = asyncio.create_task(
                    run_check(spec.quality, self._completer, spec.baseline, spec.candidate),
                    name=f"tandem-quality-{rollout.rollout_id}",
                )
                rollout.last_measured_at = now
            return
        if not task.done():
            return
        del self._quality[rollout.rollout_id]
        try:
            result = task.result()
        except Exception as exc:  # the runner turns engine errors into results; this is a bug
            log.exception("quality check of %s crashed", rollout.rollout_id)
            result = QualityResult(
                outcome="error",
                agreement=0.0,
                min_agreement=rollout.spec.quality.min_agreement,
                prompts=(),
                detail=f"the check crashed: {type(exc).__name__}: {exc}",
            )
        machine.quality_done(rollout, result, now)

    async def _measure(self, rollout: Rollout, now: float) -> list[Measurement]:
        """Every gate of the phase over the phase's window, candidate against baseline."""
        window_s = max(now - rollout.phase_started_at, 1e-3)
        shadow = rollout.phase is Phase.SHADOW
        candidate = await self._figures(rollout.spec.candidate, window_s, shadow=shadow)
        baseline = await self._figures(rollout.spec.baseline, window_s, shadow=False)
        return [measure(gate, candidate, baseline) for gate in machine.gates_of_phase(rollout)]

    async def _figures(
        self, version: str, window_s: float, *, shadow: bool
    ) -> VersionFigures | None:
        try:
            return await self._provider.figures(version, window_s, shadow=shadow)
        except MetricsUnavailable as exc:
            log.warning("no figures for %s: %s", version, exc)
            return None

    async def _announce(self, rollout: Rollout) -> None:
        """Audit each decision not announced yet, and send its webhook."""
        for index in range(rollout.announced, len(rollout.decisions)):
            decision = rollout.decisions[index]
            await self._traffic.audit(
                f"rollout.{decision.event}",
                alias=rollout.alias,
                subject=rollout.rollout_id,
                after=decision.to_dict(),
                actor=decision.actor or machine.CONTROLLER,
                reason=decision.detail,
            )
            hook = rollout.spec.webhook
            if hook is not None and self._webhooks is not None and decision.event in WEBHOOK_EVENTS:
                self._webhooks.send(
                    hook,
                    WebhookEvent(
                        event=decision.event,
                        rollout_id=rollout.rollout_id,
                        alias=rollout.alias,
                        at=decision.at,
                        data={
                            "decision": decision.to_dict(),
                            "status": rollout.status.value,
                            "baseline": rollout.spec.baseline,
                            "candidate": rollout.spec.candidate,
                        },
                        delivery_id=f"{rollout.rollout_id}-{index}",
                    ),
                )
            rollout.announced = index + 1

    async def _write_report(self, rollout: Rollout, now: float) -> list[str]:
        assert self._reports_dir is not None
        window_s = max(now - rollout.created_at, 1.0)
        versions = (rollout.spec.baseline, rollout.spec.candidate)
        try:
            ttft = {v: await self._provider.samples(v, window_s, "ttft") for v in versions}
            itl = {v: await self._provider.samples(v, window_s, "itl") for v in versions}
        except MetricsUnavailable:
            ttft, itl = {v: [] for v in versions}, {v: [] for v in versions}
        data = ReportData(
            rollout_id=rollout.rollout_id,
            alias=rollout.alias,
            baseline=rollout.spec.baseline,
            candidate=rollout.spec.candidate,
            status=rollout.status.value,
            weights=tuple(rollout.weights),
            decisions=tuple(decision.to_dict() for decision in rollout.decisions),
            ttft_s=ttft,
            itl_s=itl,
        )
        folder = self._reports_dir / rollout.rollout_id
        try:
            paths = await asyncio.to_thread(write_report, data, folder)
        except OSError as exc:
            log.error("report of %s not written to %s: %s", rollout.rollout_id, folder, exc)
            return [f"(not written: {exc})"]
        return [path.name for path in paths]
