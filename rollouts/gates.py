"""Rollout gates: a candidate version judged against its baseline over the same window.

Pure: a gate reads two ``VersionFigures`` (what the metric source said about each version over
one window) and returns a ``Measurement``; ``assess`` folds every gate's measurements so far into
the step's outcome. No clock, no I/O: the controller that takes measurements at each interval and
acts on the outcome lives elsewhere.

Verdicts, as Argo Rollouts' analysis defines them:

- ``error``: the metric source failed (figures are ``None``). Counted apart from failures and
  never promotes: missing data holds the step.
- ``inconclusive``: fewer than ``min_samples`` on a side, or a figure that cannot be computed
  yet (no tokens served, no cost measured). Holds the step.
- ``fail`` / ``pass``: the gate's rule, below.

The rules, per ``GateKind`` (``max_value`` absolute, ``max_ratio`` candidate over baseline):

- ``ttft_p95``, ``itl_p95``: nearest-rank p95 in seconds. Fails on ``p95 > max_value``, or on
  ``p95 > max_ratio x baseline p95`` when the one-sided Mann-Whitney test also says the
  candidate's values are larger (``p < alpha``): a ratio breach the test cannot tell from noise
  is not a regression. The test compares whole distributions, so a regression confined to the
  tail past the median is seen by the ratio, and by the test only as far as it moves the ranks.
- ``error_rate``, ``moderation_block_rate``: errors (blocks) per request. Fails on
  ``rate > max_value``, or on ``rate > max_ratio x baseline rate + RATE_FLOOR`` when the
  one-sided two-proportion test also says the candidate's rate is higher (``p < alpha``). The
  floor keeps a baseline with no errors from making any single error a failure.
- ``busy_cost``, ``provisioned_cost``: measured USD per 1k tokens from the cost meter. Fails on
  ``$/1k > max_value`` or ``$/1k > max_ratio x baseline $/1k``. A window's cost is a total, not
  a sample, so there is no test; ``min_samples`` counts requests. Both depend on load: at a
  small canary weight the candidate's engine batches less (busy cost per token rises) and its
  workers idle more (provisioned cost per token rises a lot), so the provisioned gate is a
  dry run by default and the busy gate's default ratio leaves room.
- ``output_length_drift``: ``|candidate mean output tokens / baseline mean - 1| <= max_value``.
- ``finish_reason_drift``: total variation distance between the two ``finish_reason`` mixes
  (half the sum of the absolute differences of the shares) ``<= max_value``.
- ``shadow_agreement``: the share of shadow comparisons where the candidate's answer agreed with
  the baseline's ``>= max_value`` (here ``max_value`` is a minimum). Reads the candidate's
  figures only; ``min_samples`` counts comparisons.

Power of the default latency gate (``python -m bench.rollouts.gates``: lognormal TTFT with sigma
0.5, the candidate's values 20 % larger, so its p95 is 20 % larger; 400 seeded trials a figure):
at alpha 0.01 one measurement detects the regression in at least 80 % of trials from **300
samples per side** (0.855; 0.51 at 100, 0.70 at 200, 0.785 at 250, 0.88 at 400); at alpha 0.05
from 250 (0.80; 0.665 at 100). With the same distribution on both sides one measurement fails
about 0.5 % of the time at 0.01 and 2-3 % at 0.05. The measurements of one step read
overlapping windows (all since the step began), so a false failure tends to repeat: the
default latency gates test at 0.01 and fail a step only after two failures in a row. Over 100
simulated rollouts of identical versions (``bench/rollouts/sim.py``) that rolled back 1; at
0.05, 7.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from core.moderation import Action
from rollouts.stats import mann_whitney, percentile, two_proportion

if TYPE_CHECKING:
    from billing.cost import CostFigure
    from traffic.windows import WindowSnapshot

RATE_FLOOR = 0.005
"""Added to ``max_ratio x baseline rate`` by the rate gates: half a percentage point."""


class GateKind(enum.StrEnum):
    """What a gate measures."""

    TTFT_P95 = "ttft_p95"
    ITL_P95 = "itl_p95"
    ERROR_RATE = "error_rate"
    BUSY_COST = "busy_cost"
    PROVISIONED_COST = "provisioned_cost"
    MODERATION_BLOCK_RATE = "moderation_block_rate"
    OUTPUT_LENGTH_DRIFT = "output_length_drift"
    FINISH_REASON_DRIFT = "finish_reason_drift"
    SHADOW_AGREEMENT = "shadow_agreement"


_LATENCY = frozenset({GateKind.TTFT_P95, GateKind.ITL_P95})
_RATES = frozenset({GateKind.ERROR_RATE, GateKind.MODERATION_BLOCK_RATE})
_COSTS = frozenset({GateKind.BUSY_COST, GateKind.PROVISIONED_COST})
_SHARES = frozenset({GateKind.FINISH_REASON_DRIFT, GateKind.SHADOW_AGREEMENT})
"""Kinds whose ``max_value`` is a share between 0 and 1."""
_VALUE_ONLY = frozenset({GateKind.OUTPUT_LENGTH_DRIFT, *_SHARES})


class Verdict(enum.StrEnum):
    """A measurement's verdict, and a step's outcome (Argo's Successful, Failed, Inconclusive,
    Error)."""

    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class VersionFigures:
    """What a gate reads about one version over one window."""

    num_requests: int
    num_errors: int
    ttft_samples: tuple[float, ...]
    """Seconds, successful requests only."""
    itl_samples: tuple[float, ...]
    """Mean inter-token latency per successful request, seconds."""
    output_tokens_mean: float | None
    """Mean output tokens per successful request; None without any."""
    finish_reasons: Mapping[str, int]
    moderation_blocks: int
    """Requests a moderation BLOCK refused or cut short."""
    busy_usd_per_1k: Decimal | None
    """None: no tokens served in the window, or no cost meter."""
    provisioned_usd_per_1k: Decimal | None
    shadow_compared: int = 0
    """Shadow copies of this version whose answers were compared with the primary's."""
    shadow_same: int = 0
    """Of those, the ones that agreed."""

    @classmethod
    def of_latency(
        cls, ttft_samples: Iterable[float], itl_samples: Iterable[float] = ()
    ) -> VersionFigures:
        """Figures carrying latency samples only (every request a success): what a latency
        gate reads, for studies of its power."""
        ttft = tuple(ttft_samples)
        return cls(
            num_requests=len(ttft),
            num_errors=0,
            ttft_samples=ttft,
            itl_samples=tuple(itl_samples),
            output_tokens_mean=None,
            finish_reasons={},
            moderation_blocks=0,
            busy_usd_per_1k=None,
            provisioned_usd_per_1k=None,
        )

    @classmethod
    def from_window(
        cls,
        snapshot: WindowSnapshot,
        ttft_samples: Iterable[float],
        itl_samples: Iterable[float],
        cost: CostFigure | None = None,
    ) -> VersionFigures:
        """A version's figures from its ``traffic.windows`` snapshot, the latency samples of the
        same window (``VersionWindows.samples``) and, when a cost meter runs, its cost figure."""
        successes = snapshot.num_requests - snapshot.num_errors
        return cls(
            num_requests=snapshot.num_requests,
            num_errors=snapshot.num_errors,
            ttft_samples=tuple(ttft_samples),
            itl_samples=tuple(itl_samples),
            # Failed requests count their tokens too, if any; they are few next to successes.
            output_tokens_mean=snapshot.output_tokens / successes if successes > 0 else None,
            finish_reasons=dict(snapshot.finish_reasons),
            moderation_blocks=snapshot.moderation.get(Action.BLOCK.value, 0),
            busy_usd_per_1k=None if cost is None else cost.busy_usd_per_1k_tokens,
            provisioned_usd_per_1k=None if cost is None else cost.provisioned_usd_per_1k_tokens,
        )


@dataclass(frozen=True, slots=True)
class Gate:
    """One condition a candidate must meet at every step (see the module docstring's rules)."""

    kind: GateKind
    max_value: float | None = None
    """Absolute limit in the figure's unit (seconds, rate, USD per 1k tokens, drift); for
    ``shadow_agreement``, the minimum agreement."""
    max_ratio: float | None = None
    """Limit on candidate / baseline (latency, rates, cost)."""
    min_samples: int = 100
    """Below this many samples on a side the measurement is inconclusive."""
    alpha: float = 0.05
    """Significance a ratio breach of a latency or rate gate needs to count as a failure."""
    failure_limit: int = 1
    """Consecutive failed measurements before the gate fails the step."""
    dry_run: bool = False
    """Measured and reported, never fails (nor holds) a step."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", GateKind(self.kind))
        except ValueError:
            kinds = ", ".join(kind.value for kind in GateKind)
            raise ValueError(f"gate kind {self.kind!r} is not one of: {kinds}") from None
        if self.kind in _VALUE_ONLY:
            if self.max_value is None or self.max_ratio is not None:
                raise ValueError(f"a {self.kind} gate needs max_value and takes no max_ratio")
        elif self.max_value is None and self.max_ratio is None:
            raise ValueError(f"a {self.kind} gate needs max_value, max_ratio or both")
        if self.max_value is not None and not (
            math.isfinite(self.max_value) and self.max_value >= 0
        ):
            raise ValueError(f"{self.kind}: max_value must be a finite number >= 0")
        if self.kind in _SHARES and self.max_value is not None and self.max_value > 1:
            raise ValueError(f"{self.kind}: max_value is a share and must be at most 1")
        if self.max_ratio is not None and not (
            math.isfinite(self.max_ratio) and self.max_ratio > 0
        ):
            raise ValueError(f"{self.kind}: max_ratio must be a finite number > 0")
        if self.min_samples < 1:
            raise ValueError(f"{self.kind}: min_samples must be at least 1")
        if not 0 < self.alpha < 1:
            raise ValueError(f"{self.kind}: alpha must be between 0 and 1 (exclusive)")
        if self.failure_limit < 1:
            raise ValueError(f"{self.kind}: failure_limit must be at least 1")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "kind": self.kind.value,
            "max_value": self.max_value,
            "max_ratio": self.max_ratio,
            "min_samples": self.min_samples,
            "alpha": self.alpha,
            "failure_limit": self.failure_limit,
            "dry_run": self.dry_run,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Gate:
        """The gate ``to_dict`` wrote, or an operator's: ``kind`` and any of the limits (the
        others default). ``ValueError`` naming the field at fault."""
        if not isinstance(data, Mapping):
            raise ValueError("a gate is an object: {kind, max_value, max_ratio, ...}")
        unknown = sorted(set(data) - _GATE_FIELDS)
        if unknown:
            raise ValueError(f"unknown gate field {unknown[0]!r}; known: {sorted(_GATE_FIELDS)}")
        if "kind" not in data:
            raise ValueError("a gate needs its kind")
        fields: dict[str, Any] = {"kind": data["kind"]}
        for name in ("max_value", "max_ratio", "alpha"):
            value = data.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise ValueError(f"{data['kind']}: {name} must be a number")
                fields[name] = float(value)
        for name in ("min_samples", "failure_limit"):
            value = data.get(name)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ValueError(f"{data['kind']}: {name} must be a whole number")
                fields[name] = value
        if data.get("dry_run") is not None:
            if not isinstance(data["dry_run"], bool):
                raise ValueError(f"{data['kind']}: dry_run must be true or false")
            fields["dry_run"] = data["dry_run"]
        return cls(**fields)


_GATE_FIELDS = frozenset(
    {"kind", "max_value", "max_ratio", "min_samples", "alpha", "failure_limit", "dry_run"}
)


def default_gates(*, shadow: bool = False, cost: bool = True) -> tuple[Gate, ...]:
    """The gates a rollout gets unless it names its own. Relative limits only: an absolute SLO
    (TTFT p95 <= 2 s) is the operator's to set. ``cost``: a cost meter prices the workers;
    ``shadow``: the rollout mirrors traffic and compares answers.

    - Latency: p95 at most x1.1 the baseline's, significant at 0.01, 100 samples, two failed
      measurements in a row (see the module docstring for power and false failures).
    - Errors and moderation blocks: at most x1.5 the baseline's rate + 0.5 points, significant
      at 0.05, 200 requests.
    - Busy cost: at most x1.5 the baseline's $/1k (load makes it noisy: see the module
      docstring); provisioned cost: the same, as a dry run.
    - Output length: mean within 25 %, finish reasons within 0.1 total variation, 200 requests
      (point estimates: output lengths vary a lot, so the limits are loose).
    - Shadow agreement: at least 80 % of 50 comparisons.
    """
    gates = [
        Gate(GateKind.TTFT_P95, max_ratio=1.1, min_samples=100, alpha=0.01, failure_limit=2),
        Gate(GateKind.ITL_P95, max_ratio=1.1, min_samples=100, alpha=0.01, failure_limit=2),
        Gate(GateKind.ERROR_RATE, max_ratio=1.5, min_samples=200),
        Gate(GateKind.MODERATION_BLOCK_RATE, max_ratio=1.5, min_samples=200),
        Gate(GateKind.OUTPUT_LENGTH_DRIFT, max_value=0.25, min_samples=200),
        Gate(GateKind.FINISH_REASON_DRIFT, max_value=0.1, min_samples=200),
    ]
    if cost:
        gates.append(Gate(GateKind.BUSY_COST, max_ratio=1.5, min_samples=100))
        gates.append(Gate(GateKind.PROVISIONED_COST, max_ratio=1.5, min_samples=100, dry_run=True))
    if shadow:
        gates.append(Gate(GateKind.SHADOW_AGREEMENT, max_value=0.8, min_samples=50))
    return tuple(gates)


@dataclass(frozen=True, slots=True)
class Measurement:
    """One gate's verdict over one window."""

    gate: Gate
    verdict: Verdict
    candidate_value: float | None
    """The candidate's figure: p95 seconds, rate, USD per 1k, mean output tokens; for
    ``finish_reason_drift`` the distance and for ``shadow_agreement`` the agreement."""
    baseline_value: float | None
    """The baseline's figure where there is one."""
    num_samples: int
    """Samples on the candidate's side."""
    baseline_samples: int
    p_value: float | None
    """The significance test's one-sided p-value, when one ran."""
    detail: str
    """The verdict in one sentence, for an operator."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "gate": self.gate.to_dict(),
            "verdict": self.verdict.value,
            "candidate_value": self.candidate_value,
            "baseline_value": self.baseline_value,
            "num_samples": self.num_samples,
            "baseline_samples": self.baseline_samples,
            "p_value": self.p_value,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
        """The measurement ``to_dict`` wrote (a rollout's history, read back after a restart)."""
        return cls(
            gate=Gate.from_dict(data["gate"]),
            verdict=Verdict(data["verdict"]),
            candidate_value=data["candidate_value"],
            baseline_value=data["baseline_value"],
            num_samples=data["num_samples"],
            baseline_samples=data["baseline_samples"],
            p_value=data["p_value"],
            detail=data["detail"],
        )


def measure(
    gate: Gate, candidate: VersionFigures | None, baseline: VersionFigures | None
) -> Measurement:
    """``gate``'s verdict on ``candidate`` against ``baseline`` (figures of the same window).
    ``None`` figures mean the metric source failed."""
    if candidate is None or baseline is None:
        side = "candidate" if candidate is None else "baseline"
        return _measurement(gate, Verdict.ERROR, 0, 0, f"no figures for the {side}")
    num_samples, baseline_samples = _sample_counts(gate.kind, candidate, baseline)
    needs_baseline = gate.kind is not GateKind.SHADOW_AGREEMENT
    if num_samples < gate.min_samples or (needs_baseline and baseline_samples < gate.min_samples):
        return _measurement(
            gate,
            Verdict.INCONCLUSIVE,
            num_samples,
            baseline_samples,
            f"too few samples: {num_samples} for the candidate"
            + (f", {baseline_samples} for the baseline" if needs_baseline else "")
            + f", {gate.min_samples} needed",
        )
    counts = (num_samples, baseline_samples)
    if gate.kind in _LATENCY:
        return _latency(gate, candidate, baseline, counts)
    if gate.kind in _RATES:
        return _rate(gate, candidate, baseline, counts)
    if gate.kind in _COSTS:
        return _cost(gate, candidate, baseline, counts)
    if gate.kind is GateKind.OUTPUT_LENGTH_DRIFT:
        return _length_drift(gate, candidate, baseline, counts)
    if gate.kind is GateKind.FINISH_REASON_DRIFT:
        return _finish_drift(gate, candidate, baseline, counts)
    return _agreement(gate, candidate, counts)


def _sample_counts(
    kind: GateKind, candidate: VersionFigures, baseline: VersionFigures
) -> tuple[int, int]:
    if kind is GateKind.TTFT_P95:
        return len(candidate.ttft_samples), len(baseline.ttft_samples)
    if kind is GateKind.ITL_P95:
        return len(candidate.itl_samples), len(baseline.itl_samples)
    if kind is GateKind.FINISH_REASON_DRIFT:
        return sum(candidate.finish_reasons.values()), sum(baseline.finish_reasons.values())
    if kind is GateKind.SHADOW_AGREEMENT:
        return candidate.shadow_compared, baseline.shadow_compared
    return candidate.num_requests, baseline.num_requests


def _latency(
    gate: Gate, candidate: VersionFigures, baseline: VersionFigures, counts: tuple[int, int]
) -> Measurement:
    name = "TTFT" if gate.kind is GateKind.TTFT_P95 else "ITL"
    ours, theirs = (
        (candidate.ttft_samples, baseline.ttft_samples)
        if gate.kind is GateKind.TTFT_P95
        else (candidate.itl_samples, baseline.itl_samples)
    )
    value, base = percentile(ours, 95), percentile(theirs, 95)
    said = f"{name} p95 {value:.3f} s against the baseline's {base:.3f} s"
    verdict, why, p_value = _judged(
        gate, value, None if gate.max_ratio is None else gate.max_ratio * base,
        lambda limit: f"{limit:g} s", "slower", lambda: mann_whitney(ours, theirs).p_greater,
    )  # fmt: skip
    return _measurement(gate, verdict, *counts, f"{said}: {why}", value, base, p_value)


def _judged(
    gate: Gate,
    value: float,
    ratio_bound: float | None,
    limit_text: Callable[[float], str],
    worse: str,
    p_greater: Callable[[], float],
) -> tuple[Verdict, str, float | None]:
    """The absolute limit first (``limit_text`` renders it); then a value past ``ratio_bound``
    (``max_ratio`` times the baseline's, None without a ratio) fails only when the one-sided
    test (``p_greater``, computed only then) says the candidate is ``worse``: noise is not a
    regression."""
    if gate.max_value is not None and value > gate.max_value:
        return Verdict.FAIL, f"over the {limit_text(gate.max_value)} limit", None
    if ratio_bound is not None and value > ratio_bound:
        p_value = p_greater()
        said = f"over x{gate.max_ratio:g}"
        if p_value < gate.alpha:
            return Verdict.FAIL, f"{said}, significantly {worse} (p={p_value:.2g})", p_value
        return Verdict.PASS, f"{said} but not significantly {worse} (p={p_value:.2g})", p_value
    return Verdict.PASS, "within limits", None


def _rate(
    gate: Gate, candidate: VersionFigures, baseline: VersionFigures, counts: tuple[int, int]
) -> Measurement:
    if gate.kind is GateKind.ERROR_RATE:
        name, ours, theirs = "error rate", candidate.num_errors, baseline.num_errors
    else:
        name, ours, theirs = "block rate", candidate.moderation_blocks, baseline.moderation_blocks
    value, base = ours / candidate.num_requests, theirs / baseline.num_requests
    said = f"{name} {value:.2%} against the baseline's {base:.2%}"
    # The floor keeps a baseline without errors from making any one error a failure.
    bound = None if gate.max_ratio is None else gate.max_ratio * base + RATE_FLOOR
    verdict, why, p_value = _judged(
        gate, value, bound, lambda limit: f"{limit:.2%}", "higher",
        lambda: two_proportion(ours, candidate.num_requests, theirs, baseline.num_requests),
    )  # fmt: skip
    return _measurement(gate, verdict, *counts, f"{said}: {why}", value, base, p_value)


def _cost(
    gate: Gate, candidate: VersionFigures, baseline: VersionFigures, counts: tuple[int, int]
) -> Measurement:
    busy = gate.kind is GateKind.BUSY_COST
    name = "busy" if busy else "provisioned"
    ours = candidate.busy_usd_per_1k if busy else candidate.provisioned_usd_per_1k
    theirs = baseline.busy_usd_per_1k if busy else baseline.provisioned_usd_per_1k
    if ours is None or theirs is None:
        side = "candidate" if ours is None else "baseline"
        return _measurement(
            gate, Verdict.INCONCLUSIVE, *counts, f"no {name} cost measured for the {side}"
        )
    said = f"{name} cost ${ours:.6f} per 1k tokens against the baseline's ${theirs:.6f}"
    # Decimal against Decimal: str() keeps the limit as written (1.1, not 1.100000000000000088).
    if gate.max_value is not None and ours > Decimal(str(gate.max_value)):
        verdict, why = Verdict.FAIL, f"over the ${gate.max_value:g} limit"
    elif gate.max_ratio is not None and ours > Decimal(str(gate.max_ratio)) * theirs:
        verdict, why = Verdict.FAIL, f"over x{gate.max_ratio:g}"
    else:
        verdict, why = Verdict.PASS, "within limits"
    return _measurement(gate, verdict, *counts, f"{said}: {why}", float(ours), float(theirs))


def _length_drift(
    gate: Gate, candidate: VersionFigures, baseline: VersionFigures, counts: tuple[int, int]
) -> Measurement:
    ours, theirs = candidate.output_tokens_mean, baseline.output_tokens_mean
    if ours is None or theirs is None:
        side = "candidate" if ours is None else "baseline"
        return _measurement(gate, Verdict.INCONCLUSIVE, *counts, f"no output for the {side}")
    assert gate.max_value is not None  # checked by Gate
    drift = abs(ours / theirs - 1) if theirs > 0 else (0.0 if ours == 0 else math.inf)
    verdict = Verdict.FAIL if drift > gate.max_value else Verdict.PASS
    detail = (
        f"mean output {ours:.1f} tokens against the baseline's {theirs:.1f}: drift {drift:.1%}, "
        f"{'over' if verdict is Verdict.FAIL else 'within'} the {gate.max_value:.0%} limit"
    )
    return _measurement(gate, verdict, *counts, detail, ours, theirs)


def _finish_drift(
    gate: Gate, candidate: VersionFigures, baseline: VersionFigures, counts: tuple[int, int]
) -> Measurement:
    ours, theirs = candidate.finish_reasons, baseline.finish_reasons
    num_ours, num_theirs = counts
    distance = 0.5 * sum(
        abs(ours.get(reason, 0) / num_ours - theirs.get(reason, 0) / num_theirs)
        for reason in ours.keys() | theirs.keys()
    )
    assert gate.max_value is not None  # checked by Gate
    verdict = Verdict.FAIL if distance > gate.max_value else Verdict.PASS
    detail = (
        f"finish_reason mix {_mix(ours, num_ours)} against the baseline's "
        f"{_mix(theirs, num_theirs)}: distance {distance:.3f}, "
        f"{'over' if verdict is Verdict.FAIL else 'within'} the {gate.max_value:g} limit"
    )
    return _measurement(gate, verdict, *counts, detail, distance)


def _agreement(gate: Gate, candidate: VersionFigures, counts: tuple[int, int]) -> Measurement:
    agreement = candidate.shadow_same / candidate.shadow_compared
    assert gate.max_value is not None  # checked by Gate
    verdict = Verdict.FAIL if agreement < gate.max_value else Verdict.PASS
    detail = (
        f"shadow answers agreed {candidate.shadow_same} times in {candidate.shadow_compared} "
        f"({agreement:.0%}), {'under' if verdict is Verdict.FAIL else 'at or over'} "
        f"the {gate.max_value:.0%} minimum"
    )
    return _measurement(gate, verdict, *counts, detail, agreement)


def _mix(counts: Mapping[str, int], total: int) -> str:
    return ", ".join(f"{reason} {count / total:.0%}" for reason, count in sorted(counts.items()))


def _measurement(
    gate: Gate,
    verdict: Verdict,
    num_samples: int,
    baseline_samples: int,
    detail: str,
    candidate_value: float | None = None,
    baseline_value: float | None = None,
    p_value: float | None = None,
) -> Measurement:
    return Measurement(
        gate=gate,
        verdict=verdict,
        candidate_value=candidate_value,
        baseline_value=baseline_value,
        num_samples=num_samples,
        baseline_samples=baseline_samples,
        p_value=p_value,
        detail=detail[:1].upper() + detail[1:] + ".",
    )


@dataclass(frozen=True, slots=True)
class StepAssessment:
    """A step's outcome from its gates' measurements so far."""

    outcome: Verdict
    """``fail``: roll back; ``error``: a metric source failed, hold; ``inconclusive``: hold and
    measure again; ``pass``: every gate that counts passed its latest measurement."""
    latest: tuple[Measurement, ...]
    """Each gate's latest measurement, dry runs included, in the order of the gates."""
    failed: tuple[Gate, ...] = ()
    """The gates that failed the step."""
    detail: str = ""
    """The outcome in one sentence."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {
            "outcome": self.outcome.value,
            "latest": [measurement.to_dict() for measurement in self.latest],
            "failed": [gate.to_dict() for gate in self.failed],
            "detail": self.detail,
        }


def assess(gates: Sequence[Gate], history: Sequence[Measurement]) -> StepAssessment:
    """The step's outcome from every measurement taken during it, oldest first.

    Dry-run gates are reported but never decide. For the others, in this order:

    1. ``fail`` when a gate's last ``failure_limit`` measurements with a verdict (pass or fail:
       errors and inconclusive ones carry no evidence and are skipped) all failed;
    2. ``error`` when a gate's latest measurement is an error: missing data never promotes;
    3. ``inconclusive`` when a gate has no measurement yet, its latest is inconclusive, or it
       failed fewer than ``failure_limit`` times in a row so far;
    4. ``pass``: every gate's latest measurement passed.

    A failure outranks an error: the evidence already says the candidate is worse.
    """
    unique = list(dict.fromkeys(gates))
    per_gate: dict[Gate, list[Measurement]] = {gate: [] for gate in unique}
    for measurement in history:
        if measurement.gate in per_gate:
            per_gate[measurement.gate].append(measurement)
    latest = tuple(per_gate[gate][-1] for gate in unique if per_gate[gate])
    deciding = [gate for gate in unique if not gate.dry_run]
    in_a_row = {gate: _failed_in_a_row(per_gate[gate]) for gate in deciding}
    failed = tuple(gate for gate in deciding if in_a_row[gate] >= gate.failure_limit)
    if failed:
        kinds = ", ".join(gate.kind.value for gate in failed)
        return StepAssessment(Verdict.FAIL, latest, failed, f"failed: {kinds}")
    last = {gate: per_gate[gate][-1].verdict if per_gate[gate] else None for gate in deciding}
    errored = [gate.kind.value for gate in deciding if last[gate] is Verdict.ERROR]
    if errored:
        return StepAssessment(
            Verdict.ERROR, latest, detail=f"metric source failed for: {', '.join(errored)}"
        )
    waiting = [
        gate.kind.value
        if last[gate] is not Verdict.FAIL
        else f"{gate.kind.value} (failed {in_a_row[gate]} of {gate.failure_limit} in a row)"
        for gate in deciding
        if last[gate] is not Verdict.PASS
    ]
    if waiting:
        return StepAssessment(
            Verdict.INCONCLUSIVE, latest, detail=f"not passed yet: {', '.join(waiting)}"
        )
    return StepAssessment(Verdict.PASS, latest, detail="every gate passed")


def _failed_in_a_row(measurements: Sequence[Measurement]) -> int:
    count = 0
    for measurement in reversed(measurements):
        if measurement.verdict is Verdict.FAIL:
            count += 1
        elif measurement.verdict is Verdict.PASS:
            break
    return count
