"""rollouts.gates with seeded figures: each default gate fails a bad candidate and passes a
healthy one; the same distributions on both sides never roll back (20 of 20 seeded steps); too
few samples is inconclusive, missing figures an error; dry runs and failure limits in ``assess``;
the latency gate's power against a 20 % p95 regression (the figure in the module docstring)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from decimal import Decimal
from typing import Any

import pytest

import rollouts
from billing.cost import CostFigure
from rollouts import (
    Gate,
    GateKind,
    Measurement,
    Verdict,
    VersionFigures,
    assess,
    default_gates,
    measure,
)
from traffic.windows import RequestFigures, VersionWindows

GATES = {gate.kind: gate for gate in default_gates(shadow=True)}
TTFT = GATES[GateKind.TTFT_P95]


def figures(
    rng: random.Random,
    *,
    num_requests: int = 1000,
    num_samples: int = 300,
    ttft_scale: float = 1.0,
    itl_scale: float = 1.0,
    error_rate: float = 0.005,
    block_rate: float = 0.005,
    mean_tokens: float = 100.0,
    length_share: float = 0.05,
    busy: str | None = "0.0100",
    provisioned: str | None = "0.0200",
    agreement: float = 0.95,
) -> VersionFigures:
    """One version's figures over one window, drawn from ``rng``: lognormal latencies,
    binomial errors, blocks and finish reasons, a noisy mean output length."""

    def binomial(p: float) -> int:
        return sum(rng.random() < p for _ in range(num_requests))

    num_errors = binomial(error_rate)
    successes = num_requests - num_errors
    num_length = sum(rng.random() < length_share for _ in range(successes))
    return VersionFigures(
        num_requests=num_requests,
        num_errors=num_errors,
        ttft_samples=tuple(
            ttft_scale * rng.lognormvariate(math.log(0.3), 0.5) for _ in range(num_samples)
        ),
        itl_samples=tuple(
            itl_scale * rng.lognormvariate(math.log(0.02), 0.3) for _ in range(num_samples)
        ),
        output_tokens_mean=mean_tokens * rng.gauss(1, 0.03),
        finish_reasons={"length": num_length, "stop": successes - num_length},
        moderation_blocks=binomial(block_rate),
        busy_usd_per_1k=None if busy is None else Decimal(busy),
        provisioned_usd_per_1k=None if provisioned is None else Decimal(provisioned),
        shadow_compared=100,
        shadow_same=round(100 * agreement),
    )


BAD: dict[GateKind, dict[str, Any]] = {
    GateKind.TTFT_P95: {"ttft_scale": 1.5},
    GateKind.ITL_P95: {"itl_scale": 1.5},
    GateKind.ERROR_RATE: {"error_rate": 0.05},
    GateKind.MODERATION_BLOCK_RATE: {"block_rate": 0.05},
    GateKind.BUSY_COST: {"busy": "0.0200"},
    GateKind.PROVISIONED_COST: {"provisioned": "0.0400"},
    GateKind.OUTPUT_LENGTH_DRIFT: {"mean_tokens": 150.0},
    GateKind.FINISH_REASON_DRIFT: {"length_share": 0.4},
    GateKind.SHADOW_AGREEMENT: {"agreement": 0.4},
}
HEALTHY: dict[str, Any] = {
    "ttft_scale": 1.02,
    "itl_scale": 0.98,
    "error_rate": 0.006,
    "block_rate": 0.004,
    "busy": "0.0105",
    "provisioned": "0.0190",
    "mean_tokens": 104.0,
    "length_share": 0.06,
    "agreement": 0.9,
}


def test_every_kind_has_a_default_gate_and_a_bad_candidate() -> None:
    assert set(GATES) == set(GateKind) == set(BAD)
    assert {gate.kind for gate in default_gates()} == set(GateKind) - {GateKind.SHADOW_AGREEMENT}
    assert not {gate.kind for gate in default_gates(cost=False)} & {
        GateKind.BUSY_COST,
        GateKind.PROVISIONED_COST,
    }


@pytest.mark.parametrize("kind", list(GateKind))
def test_each_gate_alone_fails_a_bad_candidate(kind: GateKind) -> None:
    rng = random.Random(1)
    baseline = figures(rng)
    measurement = measure(GATES[kind], figures(rng, **BAD[kind]), baseline)
    assert measurement.verdict is Verdict.FAIL, measurement.detail
    # Only this gate: the bad candidate is healthy by every other one.
    others = [measure(gate, figures(rng, **BAD[kind]), baseline) for gate in GATES.values()]
    assert [m.gate.kind for m in others if m.verdict is Verdict.FAIL] == [kind]


@pytest.mark.parametrize("kind", list(GateKind))
def test_each_gate_passes_a_healthy_candidate(kind: GateKind) -> None:
    rng = random.Random(2)
    baseline = figures(rng)
    measurement = measure(GATES[kind], figures(rng, **HEALTHY), baseline)
    assert measurement.verdict is Verdict.PASS, measurement.detail


def test_the_same_distributions_never_roll_back_20_of_20() -> None:
    """Each seeded run is one step as a controller takes it: every default gate measured on a
    fresh window each round until the step is decided; it must pass every time."""
    gates = default_gates()
    for seed in range(20):
        rng = random.Random(seed)
        history: list[Measurement] = []
        for _ in range(5):
            candidate, baseline = figures(rng), figures(rng)
            history += [measure(gate, candidate, baseline) for gate in gates]
            outcome = assess(gates, history).outcome
            if outcome is not Verdict.INCONCLUSIVE:
                break
        assert outcome is Verdict.PASS, (seed, assess(gates, history).detail)


def test_a_ratio_breach_that_could_be_noise_passes() -> None:
    rng = random.Random(5)
    baseline = sorted(rng.lognormvariate(0, 0.5) for _ in range(100))
    # The same values but the slowest six half as slow again: p95 is over x1.1, yet 94 of 100
    # values are the baseline's own, and the rank test sees no shift.
    candidate = baseline[:94] + [value * 1.5 for value in baseline[94:]]
    measurement = measure(
        TTFT, VersionFigures.of_latency(candidate), VersionFigures.of_latency(baseline)
    )
    assert measurement.candidate_value is not None and measurement.baseline_value is not None
    assert measurement.candidate_value > 1.1 * measurement.baseline_value
    assert measurement.p_value is not None and measurement.p_value > 0.05
    assert measurement.verdict is Verdict.PASS
    assert "not significantly slower" in measurement.detail
    # An absolute SLO is an SLO: no test.
    slo = Gate(GateKind.TTFT_P95, max_value=0.9 * baseline[94], min_samples=100)
    assert (
        measure(
            slo, VersionFigures.of_latency(baseline), VersionFigures.of_latency(baseline)
        ).verdict
        is Verdict.FAIL
    )


def test_a_baseline_without_errors_does_not_make_one_error_a_failure() -> None:
    rng = random.Random(6)
    baseline = dataclasses.replace(figures(rng), num_errors=0)
    candidate = dataclasses.replace(figures(rng), num_errors=3)
    assert measure(GATES[GateKind.ERROR_RATE], candidate, baseline).verdict is Verdict.PASS
    capped = Gate(GateKind.ERROR_RATE, max_value=0.002, min_samples=100)
    assert measure(capped, candidate, baseline).verdict is Verdict.FAIL


@pytest.mark.parametrize("gate", default_gates(shadow=True), ids=lambda gate: gate.kind.value)
def test_too_few_samples_is_inconclusive(gate: Gate) -> None:
    rng = random.Random(3)
    few = figures(rng, num_requests=20, num_samples=20)
    few = dataclasses.replace(few, shadow_compared=20, shadow_same=20)
    many = figures(rng)
    assert measure(gate, few, many).verdict is Verdict.INCONCLUSIVE
    if gate.kind is not GateKind.SHADOW_AGREEMENT:  # reads the candidate's figures only
        measurement = measure(gate, many, few)
        assert measurement.verdict is Verdict.INCONCLUSIVE
        assert measurement.detail.startswith("Too few samples: ")
        assert f"20 for the baseline, {gate.min_samples} needed" in measurement.detail


def test_figures_that_cannot_be_computed_yet_are_inconclusive() -> None:
    rng = random.Random(4)
    no_cost = figures(rng, busy=None, provisioned=None)
    for kind in (GateKind.BUSY_COST, GateKind.PROVISIONED_COST):
        assert measure(GATES[kind], no_cost, figures(rng)).verdict is Verdict.INCONCLUSIVE
        assert measure(GATES[kind], figures(rng), no_cost).verdict is Verdict.INCONCLUSIVE
    silent = dataclasses.replace(figures(rng), output_tokens_mean=None)
    gate = GATES[GateKind.OUTPUT_LENGTH_DRIFT]
    assert measure(gate, silent, figures(rng)).verdict is Verdict.INCONCLUSIVE


@pytest.mark.parametrize("gate", default_gates(shadow=True), ids=lambda gate: gate.kind.value)
def test_missing_figures_are_an_error(gate: Gate) -> None:
    rng = random.Random(4)
    for candidate, baseline in ((None, figures(rng)), (figures(rng), None), (None, None)):
        measurement = measure(gate, candidate, baseline)
        assert measurement.verdict is Verdict.ERROR
        assert measurement.detail.startswith("No figures for the")


def outcome_of(gates: list[Gate], verdicts: list[tuple[Gate, Verdict]]) -> Verdict:
    history = [
        Measurement(gate, verdict, None, None, 100, 100, None, verdict.value)
        for gate, verdict in verdicts
    ]
    return assess(gates, history).outcome


def test_a_dry_run_gate_never_fails_the_step() -> None:
    rng = random.Random(8)
    dry = dataclasses.replace(TTFT, dry_run=True, failure_limit=1)
    errors_gate = GATES[GateKind.ERROR_RATE]
    baseline = figures(rng)
    history = [
        measure(dry, figures(rng, ttft_scale=2.0), baseline),
        measure(errors_gate, figures(rng), baseline),
    ]
    assert history[0].verdict is Verdict.FAIL
    assessment = assess([dry, errors_gate], history)
    assert assessment.outcome is Verdict.PASS
    assert assessment.latest == tuple(history)  # reported all the same
    # Nor does it hold one: no measurement, an error or an inconclusive one.
    assert outcome_of([dry, errors_gate], [(errors_gate, Verdict.PASS)]) is Verdict.PASS
    for verdict in (Verdict.ERROR, Verdict.INCONCLUSIVE):
        history_ = [(dry, verdict), (errors_gate, Verdict.PASS)]
        assert outcome_of([dry, errors_gate], history_) is Verdict.PASS


def test_a_failure_limit_of_two_needs_two_failures_in_a_row() -> None:
    gate = Gate(GateKind.ERROR_RATE, max_ratio=1.5, failure_limit=2)
    fail, ok, error = Verdict.FAIL, Verdict.PASS, Verdict.ERROR
    assert outcome_of([gate], [(gate, fail)]) is Verdict.INCONCLUSIVE
    assert outcome_of([gate], [(gate, fail), (gate, fail)]) is Verdict.FAIL
    assert outcome_of([gate], [(gate, fail), (gate, ok), (gate, fail)]) is Verdict.INCONCLUSIVE
    assert outcome_of([gate], [(gate, fail), (gate, ok)]) is Verdict.PASS
    # Errors carry no evidence: they neither break the run nor extend it.
    assert outcome_of([gate], [(gate, fail), (gate, error), (gate, fail)]) is Verdict.FAIL
    history = [Measurement(gate, fail, None, None, 100, 100, None, "x")]
    assert "failed 1 of 2 in a row" in assess([gate], history).detail


def test_outcomes_rank_fail_error_inconclusive_pass() -> None:
    a = Gate(GateKind.ERROR_RATE, max_ratio=1.5)
    b = Gate(GateKind.MODERATION_BLOCK_RATE, max_ratio=1.5)
    fail, ok, error, unsure = Verdict.FAIL, Verdict.PASS, Verdict.ERROR, Verdict.INCONCLUSIVE
    assert outcome_of([a, b], [(a, fail), (b, error)]) is Verdict.FAIL
    assert outcome_of([a, b], [(a, unsure), (b, error)]) is Verdict.ERROR
    assert outcome_of([a, b], [(a, ok), (b, error)]) is Verdict.ERROR
    assert outcome_of([a, b], [(a, error), (a, ok), (b, ok)]) is Verdict.PASS  # latest counts
    assert outcome_of([a, b], [(a, ok), (b, unsure)]) is Verdict.INCONCLUSIVE
    assert outcome_of([a, b], [(a, ok)]) is Verdict.INCONCLUSIVE  # b not measured yet
    assert outcome_of([a, b], []) is Verdict.INCONCLUSIVE
    assert outcome_of([a, b], [(a, ok), (b, ok)]) is Verdict.PASS
    other = Gate(GateKind.ERROR_RATE, max_ratio=3.0)  # not one of the step's gates: ignored
    assert outcome_of([a, b], [(a, ok), (b, ok), (other, fail)]) is Verdict.PASS


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "tpot_p95", "max_ratio": 1.1}, "not one of"),
        ({"kind": GateKind.TTFT_P95}, "needs max_value, max_ratio or both"),
        ({"kind": GateKind.FINISH_REASON_DRIFT, "max_ratio": 1.1}, "needs max_value"),
        ({"kind": GateKind.SHADOW_AGREEMENT, "max_value": 1.5}, "at most 1"),
        ({"kind": GateKind.TTFT_P95, "max_value": -1.0}, "max_value must be"),
        ({"kind": GateKind.TTFT_P95, "max_ratio": 0.0}, "max_ratio must be"),
        ({"kind": GateKind.TTFT_P95, "max_ratio": math.inf}, "max_ratio must be"),
        ({"kind": GateKind.TTFT_P95, "max_ratio": 1.1, "min_samples": 0}, "min_samples"),
        ({"kind": GateKind.TTFT_P95, "max_ratio": 1.1, "alpha": 1.0}, "alpha"),
        ({"kind": GateKind.TTFT_P95, "max_ratio": 1.1, "failure_limit": 0}, "failure_limit"),
    ],
)
def test_gates_are_checked(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Gate(**kwargs)


def test_a_kind_may_be_given_by_name() -> None:
    assert Gate("ttft_p95", max_ratio=1.1).kind is GateKind.TTFT_P95  # type: ignore[arg-type]


def test_figures_from_a_window_and_a_cost_figure() -> None:
    windows = VersionWindows(clock=lambda: 100.0)
    for i in range(8):
        windows.observe("a@2", RequestFigures(0.1 * (i + 1), 0.02, 1.0, None, 10, "stop", None))
    windows.observe("a@2", RequestFigures(0.2, 0.02, 1.0, None, 4, "content_filter", "block"))
    windows.observe("a@2", RequestFigures(None, None, 0.01, "engine_error", 0, None, None))
    snapshot = windows.snapshot("a@2", 60)
    cost = CostFigure(
        deployment="a",
        model_version="a@2",
        window_s=60,
        wall_s=60,
        num_tokens=84,
        busy_s=1.0,
        worker_s=60.0,
        busy_cost_micros=Decimal(1),
        provisioned_cost_micros=Decimal(60),
        charged_micros=100,
        busy_usd_per_1k_tokens=Decimal("0.0119"),
        provisioned_usd_per_1k_tokens=Decimal("0.714"),
        charged_usd_per_1k_tokens=Decimal("1.19"),
        margin_micros=Decimal(40),
        margin_ratio=Decimal("0.4"),
    )
    got = VersionFigures.from_window(
        snapshot, windows.samples("a@2", 60, "ttft"), windows.samples("a@2", 60, "itl"), cost
    )
    assert (got.num_requests, got.num_errors, got.moderation_blocks) == (10, 1, 1)
    assert len(got.ttft_samples) == len(got.itl_samples) == 9
    assert got.output_tokens_mean == pytest.approx(84 / 9)
    assert got.finish_reasons == {"content_filter": 1, "stop": 8}
    assert (got.busy_usd_per_1k, got.provisioned_usd_per_1k) == (
        Decimal("0.0119"),
        Decimal("0.714"),
    )
    assert (got.shadow_compared, got.shadow_same) == (0, 0)
    bare = VersionFigures.from_window(windows.snapshot("b@1", 60), [], [])
    assert (bare.output_tokens_mean, bare.busy_usd_per_1k) == (None, None)


def test_measurements_and_assessments_are_json() -> None:
    rng = random.Random(9)
    gates = default_gates(shadow=True)
    baseline = figures(rng)
    history = [measure(gate, figures(rng, ttft_scale=1.5), baseline) for gate in gates]
    assessment = assess(gates, history)
    data = json.loads(json.dumps(assessment.to_dict()))
    assert data["outcome"] == "inconclusive"  # TTFT failed once; its limit is two
    ttft = next(m for m in data["latest"] if m["gate"]["kind"] == "ttft_p95")
    assert ttft["verdict"] == "fail"
    assert ttft["num_samples"] == 300
    assert ttft["p_value"] < 0.05
    assert ttft["detail"].startswith("TTFT p95 ")


def test_public_exports() -> None:
    assert rollouts.__all__ == [
        "RATE_FLOOR",
        "Gate",
        "GateKind",
        "MannWhitney",
        "Measurement",
        "StepAssessment",
        "Verdict",
        "VersionFigures",
        "assess",
        "default_gates",
        "mann_whitney",
        "measure",
        "percentile",
        "two_proportion",
    ]


def detection_rate(
    samples_per_side: int, slowdown: float, *, trials: int = 200, seed: int = 0, gate: Gate = TTFT
) -> float:
    """The share of ``trials`` seeded measurements in which ``gate`` fails a candidate whose
    lognormal (sigma 0.5) TTFT is ``slowdown`` times the baseline's. Run this file as a script
    to print it over a range of sizes (the figure in ``rollouts.gates``' docstring)."""
    rng = random.Random(seed)
    failed = 0
    for _ in range(trials):
        baseline = [rng.lognormvariate(math.log(0.3), 0.5) for _ in range(samples_per_side)]
        candidate = [
            slowdown * rng.lognormvariate(math.log(0.3), 0.5) for _ in range(samples_per_side)
        ]
        verdict = measure(
            gate, VersionFigures.of_latency(candidate), VersionFigures.of_latency(baseline)
        ).verdict
        failed += verdict is Verdict.FAIL
    return failed / trials


def test_the_latency_gate_detects_a_20_percent_regression_at_300_samples() -> None:
    assert detection_rate(300, 1.2) >= 0.8
    assert detection_rate(100, 1.2) < 0.8  # so 300 is not a figure any size would meet
    # With no regression, failures stay under alpha: the ratio and the test must both agree.
    assert detection_rate(250, 1.0) <= TTFT.alpha


if __name__ == "__main__":
    for size in range(100, 451, 50):  # under 100 the default gate is inconclusive
        rates = [detection_rate(size, 1.2, seed=seed) for seed in range(3)]
        print(f"{size:4d} per side: detected in {', '.join(f'{r:.3f}' for r in rates)}")
