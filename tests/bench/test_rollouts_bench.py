"""bench.rollouts: the gate figures and the two-replica rollback run end to end with tiny
parameters and print what they promise. The figures themselves are the benchmarks' to print,
not asserted here; what is asserted holds by construction or by seed."""

from __future__ import annotations

import dataclasses

import pytest

from bench.rollouts import gates as gates_bench
from bench.rollouts import rollback
from rollouts.gates import GateKind, default_gates


def test_gates_prints_the_power_table_the_rollouts_and_the_summary(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gates_bench.main(["--trials", "10", "--rollouts", "1", "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "|" in line[2:]]
    assert [row.split("|")[1].strip() for row in rows[1:]] == [str(n) for n in gates_bench.SIZES]
    assert "identical versions: rolled back in" in printed
    assert "candidate TTFT x1.2: rolled back in" in printed
    assert "samples per side for >= 80% power at alpha 0.01: " in printed


def test_a_stricter_alpha_never_fails_more_on_the_same_draws() -> None:
    [ttft] = [gate for gate in default_gates() if gate.kind is GateKind.TTFT_P95]
    gates = [ttft, dataclasses.replace(ttft, alpha=0.05)]
    row = gates_bench.power_row(gates, 150, trials=40, seed=1)
    assert row.detected[0.01] <= row.detected[0.05]
    assert row.false_failures[0.01] <= row.false_failures[0.05]
    assert row.detected[0.05] > row.false_failures[0.05]


async def test_a_regressed_candidate_is_rolled_back_in_a_simulated_rollout() -> None:
    slower = gates_bench.Behaviour(ttft_median_s=0.3)  # +50 %: caught at the first step
    outcome = await gates_bench.simulate(slower, seed=0, gates=gates_bench.sim_gates(0.01))
    assert outcome.status.value == "failed"
    assert outcome.weight_at_failure == 5.0
    assert "ttft_p95" in outcome.failed_gates
    assert outcome.rolled_back_after_s is not None and outcome.rolled_back_after_s > 0


def test_wilson_interval_brackets_the_share() -> None:
    assert gates_bench.wilson(0, 100)[0] == 0.0
    assert 0.03 < gates_bench.wilson(0, 100)[1] < 0.04
    low, high = gates_bench.wilson(50, 100)
    assert low < 0.5 < high


def test_rollback_fails_each_rollout_and_rolls_back_on_both_replicas(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert rollback.main(["--rollouts", "2", "--clients", "2", "--settle-s", "1"]) == 0
    printed = capsys.readouterr().out
    assert "2 of 2 rollouts failed and were rolled back." in printed
    assert "STILL ROUTED" not in printed
    decided = next(line for line in printed.splitlines() if "decided by: " in line)
    assert sorted(int(part.split()[-1]) for part in decided.split(": ")[1].split(", ")) in (
        [0, 2],
        [1, 1],
    )
    # The deciding replica failed the gate on its own traffic: its candidate engine saw it.
    lines = [line for line in printed.splitlines() if "rollback engine [" in line]
    assert len(lines) == 2
    for line in lines:
        decider = line.split("decided by ")[1].split(",")[0]
        words = line.split("rollback engine [")[1].split("]")[0].split()  # "A 0.123 B -"
        engine = dict(zip(words[::2], words[1::2], strict=True))
        assert engine[decider] != "-", line
    assert "rollback time (engine side)" in printed and "p99" in printed
