"""A simulator of one version's prefill and decode pools, calibrated from a worker profile,
driving the real planner code (``planner.loop.Planner``) with a simulated clock.

Fluid, one-second steps: requests arrive at the trace's rate; prompts queue for the prefill
pool (its tokens/s from the profile; with no prefill worker the decode workers prefill
colocated at ``colocated_prefill_share`` of their speed); each answer then holds a decode
slot for its output tokens times the ITL the profile gives at the pool's streams per worker
(beyond the last measured point, linear). A new worker serves ``boot_s`` after it was asked
for; a removed one leaves at once (drained: its streams finish elsewhere in this model). Every
``interval_s`` the planner sees the interval's load and mean latencies and decides; an interval
meets the SLO when its mean TTFT and mean ITL are within their targets.

    python -m bench.planner.sim            # the shipped traces: attainment, replica-hours, events
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.loop import Observation, Planner, PoolState
from planner.profile import DecodePoint, PrefillPoint, Profile
from planner.replicas import Load, Observed, Targets, needed
from planner.scaling import ScalingPolicy


@dataclass(frozen=True, slots=True)
class Traffic:
    rate: float
    """Requests per second."""
    input_tokens: float
    output_tokens: float


Trace = Callable[[float], Traffic]
"""Traffic at a second of the simulation."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: Profile
    targets: Targets
    prefill_policy: ScalingPolicy
    decode_policy: ScalingPolicy
    interval_s: float = 30.0
    boot_s: float = 60.0
    colocated_prefill_share: float = 0.5


@dataclass(frozen=True, slots=True)
class Interval:
    end_s: float
    rate: float
    ttft_s: float
    itl_s: float
    prefill: int
    """Workers present (serving or booting) after the interval's decision."""
    decode: int
    met: bool


@dataclass
class SimResult:
    duration_s: float
    intervals: list[Interval] = field(default_factory=list)
    replica_seconds: float = 0.0
    static_replicas: int = 0
    """Prefill + decode workers that static provisioning for the trace's peak needs."""
    scale_events: int = 0

    @property
    def attainment(self) -> float:
        """Share of the intervals that met both latency targets."""
        return sum(i.met for i in self.intervals) / len(self.intervals)

    @property
    def replica_hours(self) -> float:
        return self.replica_seconds / 3600

    @property
    def static_replica_hours(self) -> float:
        return self.static_replicas * self.duration_s / 3600

    @property
    def savings(self) -> float:
        """Replica-hours saved against static provisioning at the peak (0.3: 30 % fewer)."""
        return 1 - self.replica_hours / self.static_replica_hours

    @property
    def events_per_hour(self) -> float:
        return self.scale_events / (self.duration_s / 3600)


@dataclass
class _Pool:
    ready: int
    booting: list[float] = field(default_factory=list)
    """When each booting worker will serve."""

    @property
    def present(self) -> int:
        return self.ready + len(self.booting)

    def tick(self, now: float) -> None:
        done = [t for t in self.booting if t <= now]
        self.ready += len(done)
        self.booting = [t for t in self.booting if t > now]

    def resize(self, desired: int, now: float, boot_s: float) -> None:
        if desired > self.present:
            self.booting += [now + boot_s] * (desired - self.present)
            return
        excess = self.present - desired
        while excess and self.booting:  # a booting worker is the cheapest to give up
            self.booting.pop()
            excess -= 1
        self.ready -= excess


def simulate(trace: Trace, duration_s: int, config: SimConfig) -> SimResult:
    profile, targets = config.profile, config.targets
    planner = Planner(
        profile, targets, config.interval_s, config.prefill_policy, config.decode_policy
    )
    first = trace(0.0)
    sized = needed(
        Load(first.rate, first.input_tokens, first.output_tokens), profile, targets, Observed(),
        config.interval_s,
    )  # deployed for the traffic it starts with  # fmt: skip
    prefill = _Pool(max(sized.prefill, config.prefill_policy.min_replicas))
    decode = _Pool(max(sized.decode, config.decode_policy.min_replicas))
    result = SimResult(float(duration_s))
    backlog = streams = 0.0
    sums = _Sums()
    peak_prefill = peak_decode = 0
    for second in range(duration_s):
        now = float(second)
        prefill.tick(now)
        decode.tick(now)
        traffic = trace(now)
        if second % config.interval_s == 0:  # static provisioning: each pool at its own peak
            at_peak = needed(
                Load(traffic.rate, traffic.input_tokens, traffic.output_tokens), profile,
                targets, Observed(), config.interval_s,
            )  # fmt: skip
            peak_prefill = max(peak_prefill, at_peak.prefill)
            peak_decode = max(peak_decode, at_peak.decode)
        speed = profile.prefill_tokens_per_s(traffic.input_tokens)
        capacity = prefill.ready * speed or (decode.ready * speed * config.colocated_prefill_share)
        backlog += traffic.rate * traffic.input_tokens
        backlog -= min(backlog, capacity)
        ttft = (backlog / capacity if capacity else math.inf) + traffic.input_tokens / speed
        per_worker = streams / decode.ready if decode.ready else math.inf
        itl = _itl(profile, per_worker)
        if traffic.output_tokens > 0 and math.isfinite(itl):
            hold_s = traffic.output_tokens * itl  # each answer's time in a decode slot
            decay = math.exp(-1.0 / hold_s)
            streams = streams * decay + traffic.rate * hold_s * (1 - decay)
        elif traffic.output_tokens > 0:
            streams += traffic.rate
        sums.add(traffic, ttft, itl, streams)
        result.replica_seconds += prefill.present + decode.present
        if (second + 1) % config.interval_s == 0:
            seen = Observation(
                Load(*sums.load(config.interval_s), prefill_backlog_tokens=backlog),
                Observed(sums.ttft(), sums.itl()),
                PoolState(prefill.ready, len(prefill.booting)),
                PoolState(decode.ready, len(decode.booting)),
            )
            step = planner.step(now, seen)
            for pool, decision in ((prefill, step.prefill), (decode, step.decode)):
                if decision.changes:
                    result.scale_events += 1
                    pool.resize(decision.desired, now, config.boot_s)
            met = (sums.ttft() or 0.0) <= targets.ttft_s and (sums.itl() or 0.0) <= targets.itl_s
            ttft, itl = sums.ttft() or 0.0, sums.itl() or 0.0
            interval = Interval(
                now + 1, seen.load.request_rate, ttft, itl, prefill.present, decode.present, met
            )
            result.intervals.append(interval)
            sums = _Sums()
    result.static_replicas = max(peak_prefill, config.prefill_policy.min_replicas) + max(
        peak_decode, config.decode_policy.min_replicas
    )
    return result


def _itl(profile: Profile, streams_per_worker: float) -> float:
    """The profile's ITL at that many streams a worker; linear past the last measured point
    (an overloaded worker's steps grow with its batch)."""
    last = profile.decode[-1]
    if streams_per_worker <= last.concurrency:
        return profile.expected_itl_s(streams_per_worker)
    return last.itl_s * streams_per_worker / last.concurrency


@dataclass
class _Sums:
    """One interval's running sums."""

    requests: float = 0.0
    input_tokens: float = 0.0
    output_tokens: float = 0.0
    ttft_weighted: float = 0.0
    itl_weighted: float = 0.0
    stream_seconds: float = 0.0

    def add(self, traffic: Traffic, ttft: float, itl: float, streams: float) -> None:
        self.requests += traffic.rate
        self.input_tokens += traffic.rate * traffic.input_tokens
        self.output_tokens += traffic.rate * traffic.output_tokens
        self.ttft_weighted += traffic.rate * ttft
        self.itl_weighted += streams * itl if math.isfinite(itl) else streams * 1e9
        self.stream_seconds += streams

    def load(self, interval_s: float) -> tuple[float, float, float]:
        if not self.requests:
            return 0.0, 0.0, 0.0
        return (
            self.requests / interval_s,
            self.input_tokens / self.requests,
            self.output_tokens / self.requests,
        )

    def ttft(self) -> float | None:
        return self.ttft_weighted / self.requests if self.requests else None

    def itl(self) -> float | None:
        return self.itl_weighted / self.stream_seconds if self.stream_seconds > 1e-9 else None


# -- the shipped traces and the calibration the tests use ---------------------------------

DAY_S = 24 * 3600

PROFILE = Profile(
    "sim@1",
    prefill=(PrefillPoint(512, 8000.0), PrefillPoint(2048, 6000.0), PrefillPoint(8192, 4000.0)),
    decode=(DecodePoint(1, 0.015), DecodePoint(16, 0.025), DecodePoint(64, 0.045),
            DecodePoint(128, 0.08)),
)  # fmt: skip
"""A GPU-like worker: a GPU's measured profile goes here in production (``tandem profile``)."""
TARGETS = Targets(ttft_s=1.0, itl_s=0.05)


def config() -> SimConfig:
    return SimConfig(
        PROFILE,
        TARGETS,
        prefill_policy=ScalingPolicy(min_replicas=0, max_replicas=16, cooldown_s=60),
        decode_policy=ScalingPolicy(min_replicas=1, max_replicas=16, cooldown_s=60),
    )


def diurnal(t: float) -> Traffic:
    """A day: 4 req/s at night, 40 at the afternoon peak; 1k-token prompts, 256-token answers."""
    return Traffic(4 + 36 * (1 - math.cos(2 * math.pi * t / DAY_S)) / 2, 1024, 256)


def spike(t: float) -> Traffic:
    """4 req/s for two hours, ten times that for 15 minutes in the middle."""
    return Traffic(40.0 if 3600 <= t < 4500 else 4.0, 1024, 256)


def mix_change(t: float) -> Traffic:
    """An hour of long prompts and short answers, then an hour of the reverse."""
    return Traffic(8.0, 4096, 64) if t < 3600 else Traffic(8.0, 256, 1024)


def to_zero(t: float) -> Traffic:
    """An hour at 20 req/s, then nothing."""
    return Traffic(20.0 if t < 3600 else 0.0, 1024, 256)


def day(t: float) -> Traffic:
    """The shipped day: the diurnal curve; at 03:00 ten times the night's 4 req/s for 15
    minutes; 10:00-12:00 long prompts and short answers at 8 req/s, 12:00-14:00 the reverse;
    from 22:00 no traffic at all."""
    hour = t / 3600
    if 3 <= hour < 3.25:
        return Traffic(40.0, 1024, 256)
    if 10 <= hour < 14:
        return mix_change((t - 10 * 3600) / 2)  # its two hours stretched over four
    if hour >= 22:
        return Traffic(0.0, 0, 0)
    return diurnal(t)


TRACES: dict[str, tuple[Trace, int]] = {
    "day": (day, DAY_S),
    "diurnal": (diurnal, DAY_S),
    "spike": (spike, 2 * 3600),
    "mix_change": (mix_change, 2 * 3600),
    "to_zero": (to_zero, 2 * 3600),
}


def main() -> None:
    print("| trace | SLO met (intervals) | replica-hours | static at peak | saved | events/h |")
    print("|---|---|---|---|---|---|")
    for name, (trace, duration_s) in TRACES.items():
        r = simulate(trace, duration_s, config())
        print(
            f"| {name} | {r.attainment:.2%} | {r.replica_hours:.1f} | "
            f"{r.static_replica_hours:.1f} | {r.savings:.0%} | {r.events_per_hour:.1f} |"
        )


if __name__ == "__main__":
    main()
