"""The rollout controller end to end on simulated traffic (``bench/rollouts/sim.py``): the real
controller, SQLite store and lease, windows, cost meter and gates, on a fake clock.

What issue 21 asks of the fast tier: each gate alone rolls a bad candidate back; a healthy one
reaches 100 %; the same distributions on both sides pass 20 seeded runs of 20; too few samples
is inconclusive (then paused), never a success; a metrics outage is an error that holds the
weight. Then the quality check, the operator commands and the fencing of a stale lease holder.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bench.rollouts.sim import ALIAS, BASELINE, CANDIDATE, Behaviour, Sim, events
from rollouts.gates import GateKind
from rollouts.quality import QualityCheck
from rollouts.record import Phase, Rollout, Status
from rollouts.spec import Mode, RolloutSpec, Step

STEPS = (Step(5, 30), Step(25, 30), Step(50, 30))
HEALTHY = Behaviour()


def spec(**changes: object) -> RolloutSpec:
    fields: dict[str, object] = {
        "alias": ALIAS,
        "baseline": BASELINE,
        "candidate": CANDIDATE,
        "steps": STEPS,
        "interval_s": 5.0,
        "grace_s": 10.0,
    }
    fields.update(changes)
    return RolloutSpec(**fields)  # type: ignore[arg-type]


async def simulate(
    tmp_path: Path,
    candidate: Behaviour,
    *,
    seed: int = 0,
    rps: int = 200,
    seconds: float = 400,
    **spec_changes: object,
) -> tuple[Sim, Rollout]:
    sim = Sim(tmp_path, HEALTHY, candidate, seed=seed, rps=rps)
    try:
        await sim.start(spec(**spec_changes))
        return sim, await sim.run(seconds)
    finally:
        await sim.aclose()


def failed_gates(rollout: Rollout) -> set[str]:
    [failed] = [d for d in rollout.decisions if d.event == "failed"]
    return {m["gate"]["kind"] for m in failed.measurements if m["verdict"] == "fail"}


async def test_a_healthy_candidate_reaches_all_traffic_and_the_baseline_is_drained(
    tmp_path: Path,
) -> None:
    sim, rollout = await simulate(tmp_path, HEALTHY)
    assert rollout.status is Status.SUCCEEDED, rollout.decisions[-3:]
    assert events(rollout) == [
        "started",
        "quality_passed",
        "step_passed",
        "step_passed",
        "step_passed",
        "promoted",
        "succeeded",
    ]
    assert [weight for _, weight in rollout.weights] == [0.0, 5.0, 25.0, 50.0, 100.0]
    # The policies the controller put, in order; the last has the baseline gone.
    splits = [[s["weight"] for s in p["split"]] for p in sim.traffic.history]
    assert splits[:4] == [[100.0], [95.0, 5.0], [75.0, 25.0], [50.0, 50.0]]
    assert sim.traffic.policies[ALIAS]["split"] == [{"version": CANDIDATE, "weight": 100.0}]
    assert sim.traffic.drained == [BASELINE]
    # Every decision audited, with the gates' measurements on each passed step.
    actions = [action for action, _, _ in sim.traffic.audits]
    assert actions == [f"rollout.{event}" for event in events(rollout)]
    passed = [after for action, _, after in sim.traffic.audits if action == "rollout.step_passed"]
    assert all(len(after["measurements"]) >= 8 for after in passed)


BAD_CANDIDATES = {
    GateKind.TTFT_P95: Behaviour(ttft_median_s=0.3),
    GateKind.ITL_P95: Behaviour(itl_median_s=0.03),
    GateKind.ERROR_RATE: Behaviour(error_rate=0.05),
    GateKind.BUSY_COST: Behaviour(usd_per_hour=7.2),  # twice the baseline's price
    GateKind.MODERATION_BLOCK_RATE: Behaviour(block_rate=0.05),
    GateKind.OUTPUT_LENGTH_DRIFT: Behaviour(output_tokens=150),
    GateKind.FINISH_REASON_DRIFT: Behaviour(length_share=0.4),
}


@pytest.mark.parametrize("kind", list(BAD_CANDIDATES), ids=lambda kind: kind.value)
async def test_each_gate_alone_rolls_a_bad_candidate_back(tmp_path: Path, kind: GateKind) -> None:
    sim, rollout = await simulate(tmp_path, BAD_CANDIDATES[kind])
    assert rollout.status is Status.FAILED, events(rollout)
    assert events(rollout)[-2:] == ["failed", "rolled_back"]
    assert kind.value in failed_gates(rollout)
    # Rolled back: all traffic on the baseline, in the first step (the evidence comes early).
    assert sim.traffic.policies[ALIAS]["split"] == [{"version": BASELINE, "weight": 100.0}]
    assert sim.traffic.max_candidate_share() == 5.0
    assert sim.traffic.drained == []
    [audited] = [after for action, _, after in sim.traffic.audits if action == "rollout.failed"]
    assert {m["gate"]["kind"] for m in audited["measurements"]} >= {
        GateKind.TTFT_P95.value,
        GateKind.ERROR_RATE.value,
        GateKind.BUSY_COST.value,
    }


async def test_a_shadow_candidate_that_disagrees_fails_before_any_client_traffic(
    tmp_path: Path,
) -> None:
    garbage = Behaviour(answer="ctypesandand zzz qqq xxyy")
    sim, rollout = await simulate(
        tmp_path,
        garbage,
        mode=Mode.SHADOW_THEN_CANARY,
        shadow_s=30.0,
        shadow_percent=50.0,
        quality=QualityCheck(enabled=False),
    )
    assert rollout.status is Status.FAILED
    assert failed_gates(rollout) == {GateKind.SHADOW_AGREEMENT.value}
    assert sim.traffic.max_candidate_share() == 0.0
    assert any("shadow" in policy for policy in sim.traffic.history)
    assert "shadow" not in sim.traffic.policies[ALIAS]


async def test_a_healthy_shadow_phase_goes_on_to_the_canary_steps(tmp_path: Path) -> None:
    _, rollout = await simulate(
        tmp_path, HEALTHY, mode=Mode.SHADOW_THEN_CANARY, shadow_s=20.0, shadow_percent=50.0
    )
    assert rollout.status is Status.SUCCEEDED
    assert events(rollout)[:4] == ["started", "quality_passed", "step_passed", "step_passed"]
    assert "shadow phase passed" in rollout.decisions[2].detail


@pytest.mark.parametrize("seed", range(20))
async def test_the_same_distributions_never_roll_back(tmp_path: Path, seed: int) -> None:
    """20 seeded runs of 20: a candidate no different from its baseline is never rolled back
    (each run measures every gate about 18 times; the latency gates need two failures in a
    row, the rate gates significance and a floor)."""
    _, rollout = await simulate(tmp_path, HEALTHY, seed=seed)
    assert rollout.status is Status.SUCCEEDED, [d.detail for d in rollout.decisions]


async def test_too_few_samples_is_inconclusive_then_paused_never_promoted(tmp_path: Path) -> None:
    sim, rollout = await simulate(tmp_path, HEALTHY, rps=4, seconds=200)
    assert rollout.status is Status.PAUSED
    assert rollout.phase is Phase.CANARY and rollout.step_index == 0
    assert events(rollout) == ["started", "quality_passed", *["step_extended"] * 3, "paused"]
    assert any("Too few samples" in m["detail"] for m in rollout.decisions[2].measurements)
    assert "still inconclusive" in (rollout.paused_reason or "")
    # Held at the first step's weight: never promoted on missing evidence.
    assert sim.traffic.max_candidate_share() == 5.0 == sim.traffic.candidate_share()


async def test_a_metrics_outage_holds_the_weight_then_pauses(tmp_path: Path) -> None:
    sim = Sim(tmp_path, HEALTHY, HEALTHY)
    try:
        await sim.start(spec(error_limit=3))
        rollout = await sim.run(12)  # past the quality check, into the first step
        assert rollout.phase is Phase.CANARY
        sim.provider.down = True
        rollout = await sim.run(60)
        assert rollout.status is Status.PAUSED
        assert events(rollout)[-4:] == ["metrics_error"] * 3 + ["paused"]
        assert "metric source failed 3 measurements in a row" in (rollout.paused_reason or "")
        assert sim.traffic.candidate_share() == 5.0 == sim.traffic.max_candidate_share()
        # A person resumes once the metrics are back: the step starts over and goes on.
        sim.provider.down = False
        await sim.store.push_command("ro_sim", {"action": "resume", "actor": "admin-1"})
        rollout = await sim.run(400)
        assert rollout.status is Status.SUCCEEDED
        assert "resumed" in events(rollout)
    finally:
        await sim.aclose()


async def test_a_garbage_candidate_fails_the_quality_check_and_never_gets_traffic(
    tmp_path: Path,
) -> None:
    garbage = Behaviour(answer="cTypesAndAnd ... ... ... AndAndAnd")
    sim, rollout = await simulate(tmp_path, garbage)
    assert rollout.status is Status.FAILED
    assert events(rollout) == ["started", "failed"]
    assert rollout.quality is not None and rollout.quality.outcome == "fail"
    assert sim.traffic.max_candidate_share() == 0.0
    assert sim.completer.calls == 2 * len(rollout.quality.prompts)


async def test_a_quality_check_that_cannot_run_is_retried_then_paused(tmp_path: Path) -> None:
    sim = Sim(tmp_path, HEALTHY, HEALTHY)
    sim.completer.answers[CANDIDATE] = ConnectionError("decode worker unreachable")
    try:
        await sim.start(spec(error_limit=2))
        rollout = await sim.run(30)
        assert rollout.status is Status.PAUSED
        assert events(rollout) == ["started", "metrics_error", "metrics_error", "paused"]
        assert sim.traffic.max_candidate_share() == 0.0
    finally:
        await sim.aclose()


async def test_operator_commands_pause_promote_and_abort(tmp_path: Path) -> None:
    sim = Sim(tmp_path, HEALTHY, HEALTHY)
    try:
        await sim.start(spec())
        await sim.run(15)
        await sim.store.push_command("ro_sim", {"action": "pause", "actor": "admin-1"})
        rollout = await sim.run(100)
        assert rollout.status is Status.PAUSED and rollout.weight == 5.0  # held, not moving
        await sim.store.push_command(
            "ro_sim", {"action": "promote", "actor": "admin-1", "reason": "urgent fix"}
        )
        rollout = await sim.run(2)
        assert rollout.status is Status.RUNNING and rollout.phase is Phase.GRACE
        assert sim.traffic.candidate_share() == 100.0
        # Within the grace period the baseline is still deployed: an abort sends traffic back.
        await sim.store.push_command("ro_sim", {"action": "abort", "actor": "admin-2"})
        rollout = await sim.run(2)
        assert rollout.status is Status.ABORTED
        assert events(rollout)[-3:] == ["promoted", "aborted", "rolled_back"]
        assert rollout.decisions[-2].actor == "admin-2"
        assert sim.traffic.policies[ALIAS]["split"] == [{"version": BASELINE, "weight": 100.0}]
        assert sim.traffic.drained == []
    finally:
        await sim.aclose()


async def test_a_gateway_that_lost_the_lease_is_fenced_out_before_it_moves_traffic(
    tmp_path: Path,
) -> None:
    sim = Sim(tmp_path, HEALTHY, HEALTHY)
    try:
        await sim.start(spec())
        await sim.run(12)
        first = sim.controller
        assert first.fence == 1
        # gw-a stalls past its lease; gw-b takes over with a newer token.
        sim.clock.now += 6
        second = sim.new_controller("gw-b")
        assert await second.renew_lease() == 2
        puts = len(sim.traffic.history)
        await sim.store.push_command("ro_sim", {"action": "abort", "actor": "admin-1"})
        await first.run_once()  # still believes it holds token 1
        assert first.fence is None
        assert len(sim.traffic.history) == puts  # it changed nothing
        await second.run_once()
        assert (await sim.rollout()).status is Status.ABORTED
        assert sim.traffic.candidate_share() == 0.0
    finally:
        await sim.aclose()


def test_spec_rejects_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="increase"):
        spec(steps=(Step(5, 10), Step(5, 10)))
    with pytest.raises(ValueError, match="below 100"):
        spec(steps=(Step(100, 10),))
    with pytest.raises(ValueError, match="another version"):
        spec(candidate=BASELINE)
    assert replace(spec(), interval_s=1.0).interval_s == 1.0
