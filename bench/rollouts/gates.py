"""``python -m bench.rollouts.gates``: how often the default TTFT gate catches a 20 % regression,
and how often it fails a candidate that is no different from its baseline.

All of it seeded, on lognormal TTFT (sigma 0.5); the regressed candidate's values are the
baseline distribution's times 1.2, so its p95 is 20 % higher.

1. One measurement (``rollouts.gates.measure``) of ``default_gates()``' ``ttft_p95`` gate (p95 at
   most x1.1 the baseline's, and the one-sided Mann-Whitney test at alpha 0.01, 100 samples a
   side), for 100 to 500 samples a side, ``--trials`` times each: the share of trials that fail
   the regressed candidate (the power) and the share that fail a candidate drawn from the
   baseline's own distribution (false failures); the same gate at alpha 0.05 on the same draws.
2. ``--rollouts`` whole rollouts on ``bench/rollouts/sim.py`` (the real controller, SQLite store,
   lease, windows, cost meter and default gates, on a fake clock), steps 5 / 25 / 50 % x 30 s,
   200 requests a second, gates measured every 5 s: how many roll back a candidate identical to
   its baseline, and how many roll back the regressed one and how long after the candidate's
   first traffic (simulated seconds). The golden-prompt quality check is off: it sends no client
   traffic and no gate reads it. Then both again with the latency gates at alpha 0.05
   (``--sim-alpha``: the alphas to run).

    .venv/bin/python -m bench.rollouts.gates [--trials 400] [--rollouts 100] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.rollouts.sim import ALIAS, BASELINE, CANDIDATE, Behaviour, Sim
from bench.stats import percentile
from rollouts.gates import Gate, GateKind, Verdict, VersionFigures, default_gates, measure
from rollouts.quality import QualityCheck
from rollouts.record import Status
from rollouts.spec import RolloutSpec, Step

SIGMA = 0.5
MEDIAN_TTFT_S = 0.2
SLOWDOWN = 1.2
SIZES = tuple(range(100, 501, 50))
TARGET_POWER = 0.8
STEPS = (Step(5, 30), Step(25, 30), Step(50, 30))
SIM_RPS = 200
SIM_INTERVAL_S = 5.0
SIM_LIMIT_S = 400.0
"""Simulated seconds a rollout may take (one that passes every step ends at about 100)."""


def default_ttft_gate() -> Gate:
    [gate] = [gate for gate in default_gates() if gate.kind is GateKind.TTFT_P95]
    return gate


# -- one measurement ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PowerRow:
    """One size's failure rates, per gate alpha."""

    samples_per_side: int
    detected: dict[float, float]
    """Alpha -> share of trials that failed the regressed candidate."""
    false_failures: dict[float, float]
    """Alpha -> share of trials that failed a candidate drawn like its baseline."""


def power_row(gates: Sequence[Gate], size: int, trials: int, seed: int) -> PowerRow:
    """``trials`` seeded measurements of each gate at ``size`` samples a side; every gate sees
    the same draws."""
    rng = random.Random(f"{seed}:{size}")
    mu = math.log(MEDIAN_TTFT_S)
    detected = Counter[float]()
    false = Counter[float]()
    for _ in range(trials):
        baseline = VersionFigures.of_latency([rng.lognormvariate(mu, SIGMA) for _ in range(size)])
        slower = VersionFigures.of_latency(
            [SLOWDOWN * rng.lognormvariate(mu, SIGMA) for _ in range(size)]
        )
        same = VersionFigures.of_latency([rng.lognormvariate(mu, SIGMA) for _ in range(size)])
        for gate in gates:
            detected[gate.alpha] += measure(gate, slower, baseline).verdict is Verdict.FAIL
            false[gate.alpha] += measure(gate, same, baseline).verdict is Verdict.FAIL
    return PowerRow(
        size,
        {gate.alpha: detected[gate.alpha] / trials for gate in gates},
        {gate.alpha: false[gate.alpha] / trials for gate in gates},
    )


# -- whole rollouts -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SimOutcome:
    """How one simulated rollout ended."""

    seed: int
    status: Status
    rolled_back_after_s: float | None
    """Simulated seconds from the candidate's first traffic to the failed decision."""
    weight_at_failure: float | None
    """The candidate's weight (percent) when it failed."""
    failed_gates: tuple[str, ...] = ()


def sim_gates(latency_alpha: float) -> tuple[Gate, ...]:
    """The default gates (cost included, as the sim meters cost), the latency gates at
    ``latency_alpha``."""
    latency = {GateKind.TTFT_P95, GateKind.ITL_P95}
    return tuple(
        dataclasses.replace(gate, alpha=latency_alpha) if gate.kind in latency else gate
        for gate in default_gates(cost=True)
    )


async def simulate(candidate: Behaviour, seed: int, gates: tuple[Gate, ...]) -> SimOutcome:
    """One rollout of ``candidate`` over a default ``Behaviour`` baseline."""
    spec = RolloutSpec(
        alias=ALIAS,
        baseline=BASELINE,
        candidate=CANDIDATE,
        steps=STEPS,
        gates=gates,
        interval_s=SIM_INTERVAL_S,
        grace_s=10.0,
        quality=QualityCheck(enabled=False),
    )
    with tempfile.TemporaryDirectory(prefix="tandem-bench-sim-") as folder:
        sim = Sim(Path(folder), Behaviour(), candidate, seed=seed, rps=SIM_RPS)
        try:
            await sim.start(spec)
            rollout = await sim.run(SIM_LIMIT_S)
        finally:
            await sim.aclose()
    failed = [decision for decision in rollout.decisions if decision.event == "failed"]
    if not failed:
        return SimOutcome(seed, rollout.status, None, None)
    at = failed[0].at
    first_traffic = min(t for t, weight in rollout.weights if weight > 0)
    weight = [weight for t, weight in rollout.weights if t <= at and weight > 0][-1]
    kinds = tuple(
        m["gate"]["kind"] for m in failed[0].measurements if m["verdict"] == Verdict.FAIL.value
    )
    return SimOutcome(seed, rollout.status, at - first_traffic, weight, kinds)


async def simulate_many(
    candidate: Behaviour, num_rollouts: int, seed: int, gates: tuple[Gate, ...]
) -> list[SimOutcome]:
    return [await simulate(candidate, seed + i, gates) for i in range(num_rollouts)]


# -- the report ---------------------------------------------------------------------------------


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95 % by default)."""
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z / (1 + z * z / trials) * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials**2))
    return max(0.0, centre - half), min(1.0, centre + half)


def _share(count: int, total: int) -> str:
    low, high = wilson(count, total)
    return (
        f"{count} of {total} ({100 * count / total:.1f} %; 95 % CI "
        f"{100 * low:.1f}-{100 * high:.1f} %)"
    )


def print_power(rows: Sequence[PowerRow], alphas: Sequence[float], trials: int) -> None:
    gate = default_ttft_gate()
    print(
        f"ttft_p95 gate of default_gates(): p95 <= x{gate.max_ratio:g} the baseline's unless the "
        f"one-sided Mann-Whitney p >= alpha, min_samples {gate.min_samples}."
    )
    print(
        f"One measurement, {trials} seeded trials a row; lognormal TTFT (median "
        f"{MEDIAN_TTFT_S:g} s, sigma {SIGMA:g}); regressed candidate: values x{SLOWDOWN:g}."
    )
    header = " | ".join(
        f"detects x{SLOWDOWN:g} @{alpha:g} | fails same @{alpha:g}" for alpha in alphas
    )
    print(f"\n| samples/side | {header} |")
    print("|---:|" + "---:|" * 2 * len(alphas))
    for row in rows:
        cells = " | ".join(
            f"{row.detected[alpha]:.3f} | {row.false_failures[alpha]:.3f}" for alpha in alphas
        )
        print(f"| {row.samples_per_side} | {cells} |")


def print_rollouts(
    alpha: float, same: Sequence[SimOutcome], slower: Sequence[SimOutcome], elapsed_s: float
) -> None:
    print(
        f"\nSimulated rollouts, latency gates at alpha {alpha:g} (bench/rollouts/sim.py; default "
        f"gates; steps {' / '.join(f'{s.weight:g} %' for s in STEPS)} x {STEPS[0].bake_s:g} s, "
        f"{SIM_RPS} req/s, measured every {SIM_INTERVAL_S:g} s; took {elapsed_s:.0f} s):"
    )
    false = [o for o in same if o.status is Status.FAILED]
    print(f"  identical versions: rolled back in {_share(len(false), len(same))}")
    for outcome in false:
        print(
            f"    seed {outcome.seed}: at {outcome.weight_at_failure:g} %, "
            f"{outcome.rolled_back_after_s:.0f} s in, by {', '.join(outcome.failed_gates)}"
        )
    caught = [o for o in slower if o.status is Status.FAILED]
    print(f"  candidate TTFT x{SLOWDOWN:g}: rolled back in {_share(len(caught), len(slower))}")
    if caught:
        after = [o.rolled_back_after_s for o in caught if o.rolled_back_after_s is not None]
        weights = Counter(o.weight_at_failure for o in caught)
        gates = Counter(kind for o in caught for kind in o.failed_gates)
        print(
            f"    time to rollback from the candidate's first traffic: mean "
            f"{statistics.fmean(after):.1f} s, p50 {percentile(after, 50):.0f} s, "
            f"p90 {percentile(after, 90):.0f} s, max {max(after):.0f} s"
        )
        print(
            "    at weight: "
            + ", ".join(f"{w:g} %: {n}" for w, n in sorted(weights.items(), key=_weight_order))
            + "; failing gates: "
            + ", ".join(f"{kind} {n}" for kind, n in gates.most_common())
        )
    missed = Counter(o.status.value for o in slower if o.status is not Status.FAILED)
    if missed:
        print(f"    not rolled back: {dict(missed)}")


def _weight_order(item: tuple[float | None, int]) -> float:
    return item[0] or 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollouts.gates",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--trials", type=int, default=400, help="measurements a table row")
    parser.add_argument("--rollouts", type=int, default=100, help="simulated rollouts a figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sim-alpha",
        type=float,
        nargs="+",
        default=[0.01, 0.05],
        help="alphas of the latency gates in the simulated rollouts (0.01 is the default gates')",
    )
    args = parser.parse_args(argv)
    if args.trials < 1 or args.rollouts < 0:
        parser.error("--trials must be at least 1 and --rollouts at least 0")

    gate = default_ttft_gate()
    alphas = [gate.alpha, *([0.05] if gate.alpha != 0.05 else [])]
    gates = [dataclasses.replace(gate, alpha=alpha) for alpha in alphas]
    rows = [power_row(gates, size, args.trials, args.seed) for size in SIZES]
    print_power(rows, alphas, args.trials)
    sys.stdout.flush()

    for alpha in args.sim_alpha if args.rollouts else []:
        started = time.perf_counter()
        gates_at = sim_gates(alpha)
        same = asyncio.run(simulate_many(Behaviour(), args.rollouts, args.seed, gates_at))
        slower = asyncio.run(
            simulate_many(
                Behaviour(ttft_median_s=SLOWDOWN * Behaviour().ttft_median_s),
                args.rollouts,
                args.seed,
                gates_at,
            )
        )
        print_rollouts(alpha, same, slower, time.perf_counter() - started)
        sys.stdout.flush()

    # The smallest size from which every larger one in the table has the power too (one row
    # can cross the line by chance and the next fall back under it).
    enough = None
    for row in reversed(rows):
        if row.detected[gate.alpha] < TARGET_POWER:
            break
        enough = row.samples_per_side
    print(
        f"\nsamples per side for >= {TARGET_POWER:.0%} power at alpha {gate.alpha:g}: "
        + (str(enough) if enough is not None else f"more than {SIZES[-1]}")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
