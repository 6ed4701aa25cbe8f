"""A rollout's transitions: pure functions of its state, the evidence and the time.

Each function changes the ``Rollout`` it is given and appends a ``Decision`` for everything it
decided; the controller (``rollouts.controller``) does the I/O around them: measuring, putting
the traffic policy in force when ``policy_applied`` went False, saving, auditing each new
decision and sending its webhook. No clock, no I/O here, so every path is tested directly.

The life of a rollout::

    quality ──pass──> shadow (shadow_then_canary) ──pass──> canary step 0 ──pass──> step 1 ...
       │                 │                                      │
       fail              fail ─────────────> failed: weight 0 (rolled back)
                                                                 last step ──pass──> grace (100 %)
                                                                 grace_s later ──> succeeded

A phase moves on when its bake time is over and ``gates.assess`` says ``pass``; it fails at the
first ``fail``, whenever it comes. ``inconclusive`` at the end of the bake extends it by one more
bake (``inconclusive_limit`` times, then the rollout pauses for a person); ``error`` (the metric
source failed) holds it, and ``error_limit`` in a row pause it. A paused rollout holds its
weight; ``resume`` restarts the phase's window, ``promote`` goes to 100 % at once, ``abort``
rolls back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from rollouts.gates import Gate, Measurement, StepAssessment, Verdict, assess
from rollouts.quality import QualityResult
from rollouts.record import Decision, Phase, Rollout, Status
from rollouts.spec import SHADOW_PHASE_KINDS

CONTROLLER = "rollout"
"""The actor of the controller's own decisions."""

COMMANDS = ("pause", "resume", "promote", "abort")
"""What an operator may ask of a running rollout (``command``)."""

DRAIN_SETTLE_S = 5.0
"""The least time between putting 100 % on the candidate and draining the baseline, whatever
``grace_s`` says: every replica must have the new policy (its refresh is 0.5 s) and route the
requests it resolved to the baseline just before, or those would find it gone (503)."""


@dataclass(frozen=True, slots=True)
class Effects:
    """What a transition asks of the controller besides the policy and the decision log."""

    drain_baseline: bool = False
    """Undeploy the baseline now (the grace period is over)."""


def begin(rollout: Rollout, now: float, actor: str) -> None:
    """A new rollout (started by ``actor``): the quality check first, unless the spec
    switched it off."""
    rollout.updated_at = now
    _decide(
        rollout,
        now,
        "started",
        f"{rollout.spec.candidate} over {rollout.spec.baseline}, "
        f"{rollout.spec.mode.value}, steps {_steps_text(rollout)}",
        actor=actor,
    )
    if rollout.spec.quality.enabled:
        _enter(rollout, now, Phase.QUALITY, 0.0)
    else:
        _enter_traffic(rollout, now)


def gates_of_phase(rollout: Rollout) -> tuple[Gate, ...]:
    """The gates that judge the current phase."""
    if rollout.phase is Phase.SHADOW:
        return tuple(g for g in rollout.spec.gates if g.kind in SHADOW_PHASE_KINDS)
    return tuple(g for g in rollout.spec.gates if g.kind.value != "shadow_agreement")


def measurement_due(rollout: Rollout, now: float) -> bool:
    """Whether the gates are to be measured now: every ``interval_s``, and once more when the
    bake ends (so a phase moves on at its end, not up to an interval later)."""
    if rollout.status is not Status.RUNNING or rollout.phase not in (Phase.SHADOW, Phase.CANARY):
        return False
    last = rollout.last_measured_at
    since = rollout.phase_started_at if last is None else last
    if now >= since + rollout.spec.interval_s:
        return True
    deadline = rollout.step_deadline
    return now >= deadline and (last is None or last < deadline)


def quality_done(rollout: Rollout, result: QualityResult, now: float) -> None:
    """The golden prompts' verdict: on to traffic, fail (never any traffic), or count an
    error (run again; ``error_limit`` in a row pause)."""
    if rollout.status is not Status.RUNNING or rollout.phase is not Phase.QUALITY:
        return
    rollout.quality = result
    rollout.updated_at = now
    if result.outcome == "pass":
        _decide(rollout, now, "quality_passed", result.detail)
        _enter_traffic(rollout, now)
    elif result.outcome == "fail":
        _decide(rollout, now, "failed", f"quality check: {result.detail}")
        _finish(rollout, now, Status.FAILED, "never got traffic")
    else:
        rollout.consecutive_errors += 1
        _decide(rollout, now, "metrics_error", f"quality check: {result.detail}")
        if rollout.consecutive_errors >= rollout.spec.error_limit:
            _pause(
                rollout,
                now,
                f"the quality check failed to run {rollout.consecutive_errors} times in a row",
            )


def measured(rollout: Rollout, measurements: Sequence[Measurement], now: float) -> StepAssessment:
    """One round of measurements of the phase's gates; decides what the evidence says."""
    rollout.last_measured_at = now
    rollout.updated_at = now
    rollout.history.extend(measurements)
    gates = gates_of_phase(rollout)
    verdict = assess(gates, rollout.history)
    latest = tuple(m.to_dict() for m in verdict.latest)
    if verdict.outcome is Verdict.FAIL:
        _decide(rollout, now, "failed", verdict.detail, latest)
        _finish(rollout, now, Status.FAILED, "gates failed")
        return verdict
    if verdict.outcome is Verdict.ERROR:
        rollout.consecutive_errors += 1
        _decide(rollout, now, "metrics_error", verdict.detail, latest)
        if rollout.consecutive_errors >= rollout.spec.error_limit:
            _pause(
                rollout,
                now,
                f"the metric source failed {rollout.consecutive_errors} "
                "measurements in a row; the weight is held",
            )
        return verdict
    rollout.consecutive_errors = 0
    if now < rollout.step_deadline:
        return verdict
    if verdict.outcome is Verdict.PASS:
        _phase_passed(rollout, now, latest)
        return verdict
    # Inconclusive at the end of the bake: too few samples (or a latency gate failed fewer
    # times in a row than its limit). More time, up to the limit; then a person decides.
    if rollout.extensions >= rollout.spec.inconclusive_limit:
        _pause(
            rollout,
            now,
            f"still inconclusive after {rollout.extensions} extensions "
            f"({verdict.detail}); promote, resume or abort",
            latest,
        )
        return verdict
    rollout.extensions += 1
    _decide(
        rollout,
        now,
        "step_extended",
        f"{verdict.detail}; bake extended ({rollout.extensions} of "
        f"{rollout.spec.inconclusive_limit})",
        latest,
    )
    return verdict


def tick(rollout: Rollout, now: float) -> Effects:
    """Time passing: the grace period's end."""
    in_grace = rollout.status is Status.RUNNING and rollout.phase is Phase.GRACE
    grace_s = rollout.spec.grace_s
    if rollout.spec.drain_baseline:
        grace_s = max(grace_s, DRAIN_SETTLE_S)
    if not in_grace or now < rollout.phase_started_at + grace_s:
        return Effects()
    rollout.status = Status.SUCCEEDED
    rollout.phase = Phase.DONE
    rollout.updated_at = now
    drained = rollout.spec.drain_baseline
    after = "the baseline is drained" if drained else "the baseline stays deployed"
    _decide(rollout, now, "succeeded", f"{rollout.spec.candidate} serves all traffic; {after}")
    rollout.policy_applied = False  # pins on the baseline go with it
    return Effects(drain_baseline=drained)


def command(rollout: Rollout, action: str, actor: str, reason: str, now: float) -> bool:
    """An operator's ``pause``, ``resume``, ``promote`` or ``abort``; False when it does not
    apply in the rollout's state (said in the decision log)."""
    said = f" ({reason})" if reason else ""
    if not rollout.status.active:
        return False
    if action == "pause" and rollout.status is Status.RUNNING and rollout.phase is not Phase.GRACE:
        _pause(rollout, now, f"paused by {actor}{said}", actor=actor)
        return True
    if action == "resume" and rollout.status is Status.PAUSED:
        rollout.status = Status.RUNNING
        rollout.paused_reason = None
        _decide(
            rollout,
            now,
            "resumed",
            f"resumed by {actor}{said}; the phase's window restarts",
            actor=actor,
        )
        _enter(rollout, now, rollout.phase, rollout.weight, rollout.step_index)
        return True
    if action == "promote" and rollout.phase is not Phase.GRACE:
        rollout.status = Status.RUNNING
        rollout.paused_reason = None
        _decide(
            rollout,
            now,
            "promoted",
            f"promoted by {actor}{said}, skipping what was left",
            actor=actor,
        )
        _enter(rollout, now, Phase.GRACE, 100.0)
        return True
    if action == "abort":
        _decide(rollout, now, "aborted", f"aborted by {actor}{said}", actor=actor)
        _finish(rollout, now, Status.ABORTED, "aborted", actor=actor)
        return True
    return False


def split_weights(weight: float) -> tuple[float, float]:
    """(baseline, candidate) percents, exact to the 0.1 %."""
    candidate = Decimal(str(weight))
    return float(Decimal(100) - candidate), float(candidate)


def desired_policy(rollout: Rollout, existing: dict[str, Any] | None) -> dict[str, Any]:
    """The alias's traffic policy for the rollout's state, in ``traffic.policy``'s JSON shape.
    What the rollout does not own is kept from ``existing``: pins, direct access, a shadow to
    a third version (pins on a drained baseline are dropped: nothing would serve them)."""
    spec = rollout.spec
    existing = existing or {}
    baseline_share, candidate_share = split_weights(rollout.weight)
    split = [
        {"version": version, "weight": share}
        for version, share in ((spec.baseline, baseline_share), (spec.candidate, candidate_share))
        if share > 0
    ]
    drained = rollout.status is Status.SUCCEEDED and spec.drain_baseline
    pins = [
        pin for pin in existing.get("pins", []) if not (drained and pin["version"] == spec.baseline)
    ]
    shadow = existing.get("shadow")
    if shadow is not None and shadow.get("version") in (spec.baseline, spec.candidate):
        shadow = None
    if rollout.status.active and rollout.phase is Phase.SHADOW:
        shadow = {
            "version": spec.candidate,
            "percent": spec.shadow_percent,
            "max_in_flight": spec.shadow_max_in_flight,
        }
    policy: dict[str, Any] = {
        "split": split,
        "sticky": spec.mode.value == "ab" and len(split) > 1,
        "pins": pins,
        "direct_access": existing.get("direct_access", True),
    }
    if shadow is not None:
        policy["shadow"] = shadow
    return policy


def _phase_passed(rollout: Rollout, now: float, latest: tuple[dict[str, Any], ...]) -> None:
    steps = rollout.spec.steps
    if rollout.phase is Phase.SHADOW:
        _decide(rollout, now, "step_passed", "shadow phase passed", latest)
        _enter(rollout, now, Phase.CANARY, steps[0].weight, 0)
        return
    index = rollout.step_index
    _decide(
        rollout,
        now,
        "step_passed",
        f"step {index + 1} of {len(steps)} ({steps[index].weight:g} %) passed",
        latest,
    )
    if index + 1 < len(steps):
        _enter(rollout, now, Phase.CANARY, steps[index + 1].weight, index + 1)
        return
    _enter(rollout, now, Phase.GRACE, 100.0)
    _decide(
        rollout,
        now,
        "promoted",
        f"{rollout.spec.candidate} at 100 %; the baseline stays "
        f"deployed for {rollout.spec.grace_s:g} s",
    )


def _enter_traffic(rollout: Rollout, now: float) -> None:
    if rollout.spec.shadow_first:
        _enter(rollout, now, Phase.SHADOW, 0.0)
    else:
        _enter(rollout, now, Phase.CANARY, rollout.spec.steps[0].weight, 0)


def _enter(rollout: Rollout, now: float, phase: Phase, weight: float, step_index: int = 0) -> None:
    """Start ``phase`` now: a fresh window, no evidence yet."""
    rollout.phase = phase
    rollout.step_index = step_index
    rollout.phase_started_at = now
    rollout.extensions = 0
    rollout.consecutive_errors = 0
    rollout.last_measured_at = None
    rollout.history = []
    rollout.updated_at = now
    _set_weight(rollout, now, weight)
    # The shadow turns on or off with the phase even when the weight stays 0.
    rollout.policy_applied = False


def _finish(
    rollout: Rollout, now: float, status: Status, why: str, *, actor: str = CONTROLLER
) -> None:
    rolled_back = rollout.weight > 0 or rollout.phase in (Phase.SHADOW, Phase.GRACE)
    rollout.status = status
    rollout.phase = Phase.DONE
    rollout.paused_reason = None
    rollout.updated_at = now
    _set_weight(rollout, now, 0.0)
    rollout.policy_applied = False
    if rolled_back:
        _decide(
            rollout,
            now,
            "rolled_back",
            f"{why}: all traffic back on {rollout.spec.baseline}",
            actor=actor,
        )


def _pause(
    rollout: Rollout,
    now: float,
    reason: str,
    latest: tuple[dict[str, Any], ...] = (),
    *,
    actor: str = CONTROLLER,
) -> None:
    rollout.status = Status.PAUSED
    rollout.paused_reason = reason
    rollout.updated_at = now
    _decide(rollout, now, "paused", reason, latest, actor=actor)


def _set_weight(rollout: Rollout, now: float, weight: float) -> None:
    if weight != rollout.weight or not rollout.weights:
        rollout.weights.append((now, weight))
    rollout.weight = weight


def _decide(
    rollout: Rollout,
    now: float,
    event: str,
    detail: str,
    measurements: tuple[dict[str, Any], ...] = (),
    *,
    actor: str = CONTROLLER,
) -> None:
    rollout.decisions.append(Decision(now, event, detail, rollout.weight, actor, measurements))


def _steps_text(rollout: Rollout) -> str:
    return " -> ".join(f"{step.weight:g} %" for step in rollout.spec.steps) + " -> 100 %"
