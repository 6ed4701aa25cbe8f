"""One planning step for one version: observe -> predict -> size each pool -> decide.

The same code runs in the simulator (a fake clock, ``bench/planner/sim.py``) and, through the
controller (``controller.py``), in the gateway. Per pool it counts workers still starting as
present (a booting worker is capacity on its way: counting it again would add a second one), and
while a pool has workers starting its latency correction is left out: figures from a pool short of
capacity that is already coming say nothing new (Dynamo's planner over-scales decode on such
cold-start samples). A decode pool whose serving workers' KV caches are on average at or above
``Targets.kv_usage`` full gets one worker more than it has, whatever the load says (or keeps the
one starting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from planner.predict import Predictor, TrendPredictor
from planner.profile import Profile
from planner.replicas import Load, Needed, Observed, Targets, needed
from planner.scaling import Decision, PoolScaler, ScalingPolicy


@dataclass(frozen=True, slots=True)
class PoolState:
    ready: int
    """Workers serving."""
    starting: int = 0
    """Workers booting, not serving yet."""
    kv_usage: float | None = None
    """Mean KV-cache usage (0..1) of its serving workers, where the actuator knows it."""

    @property
    def present(self) -> int:
        return self.ready + self.starting


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval of one version, as the metrics showed it."""

    load: Load
    latency: Observed
    prefill: PoolState
    decode: PoolState


@dataclass(frozen=True, slots=True)
class Step:
    predicted: Load
    needed: Needed
    prefill: Decision
    decode: Decision


@dataclass
class Planner:
    """The planner of one version (its pools' scalers and its load predictors)."""

    profile: Profile
    targets: Targets
    interval_s: float
    prefill_policy: ScalingPolicy
    decode_policy: ScalingPolicy
    new_predictor: Callable[[], Predictor] = TrendPredictor
    _predictors: dict[str, Predictor] = field(init=False)
    _prefill: PoolScaler = field(init=False)
    _decode: PoolScaler = field(init=False)

    def __post_init__(self) -> None:
        self._predictors = {name: self.new_predictor() for name in ("rate", "input", "output")}
        self._prefill = PoolScaler(self.prefill_policy)
        self._decode = PoolScaler(self.decode_policy)

    def step(self, now: float, seen: Observation) -> Step:
        predicted = self._predict(seen.load)
        latency = Observed(
            ttft_s=None if seen.prefill.starting else seen.latency.ttft_s,
            itl_s=None if seen.decode.starting else seen.latency.itl_s,
        )
        sized = needed(predicted, self.profile, self.targets, latency, self.interval_s)
        kv_usage = seen.decode.kv_usage
        if kv_usage is not None and kv_usage >= self.targets.kv_usage:
            # Requests waiting for KV memory, not compute: the profile (measured with room)
            # cannot see it; one more worker adds memory (llm-d and AIBrix scale on it), and
            # one already starting is that one.
            more = 0 if seen.decode.starting else 1
            sized = replace(sized, decode=max(sized.decode, seen.decode.present + more))
        return Step(
            predicted,
            sized,
            self._prefill.decide(now, seen.prefill.present, sized.prefill),
            self._decode.decide(now, seen.decode.present, sized.decode),
        )

    def _predict(self, seen: Load) -> Load:
        predictors = self._predictors
        predictors["rate"].observe(seen.request_rate)
        if seen.request_rate > 0:  # lengths of no request are no evidence
            predictors["input"].observe(seen.input_tokens)
            predictors["output"].observe(seen.output_tokens)
        rate = predictors["rate"].predict()
        if rate * self.interval_s < 1:
            # Less than one request an interval is none: a smoothed prediction decays towards
            # zero without reaching it, and a pool must still be able to empty (Dynamo's
            # planner cannot scale down to zero traffic).
            rate = 0.0
        return Load(
            rate,
            predictors["input"].predict(),
            predictors["output"].predict(),
            seen.prefill_backlog_tokens,
            seen.waiting_requests,
        )
