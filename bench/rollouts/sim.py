"""A rollout simulated second by second: the real controller, stores, lease, windows, cost meter
and gates, driven by synthetic traffic on a fake clock (``tests/rollouts/test_controller.py``
judges its outcomes; ``bench/rollouts/gates.py`` counts false and missed rollbacks over seeds).

Each simulated second, ``rps`` requests are split between the versions by the traffic policy
the controller last put (weighted draw, as ``traffic.resolver`` does); each request draws its
figures from its version's ``Behaviour`` (seeded), is observed in the ``VersionWindows`` and
billed in the ``CostMeter`` (busy time = its end-to-end latency, priced per version), and in a
shadow phase a copy goes to the candidate and is compared. Then the controller takes one pass.
What stands in for the gateway: ``RecordingTraffic`` (the policy table, the audit log and the
deployer, in memory) and ``ScriptedCompleter`` (the golden prompts' answers per version).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from billing.cost import CostFigure, CostMeter, WorkerCost
from rollouts.controller import RolloutController
from rollouts.lease import SqliteLease
from rollouts.machine import begin
from rollouts.provider import MetricsUnavailable, WindowsProvider
from rollouts.quality import QualityCheck, compare
from rollouts.record import Rollout, Status
from rollouts.spec import RolloutSpec, gates_for
from rollouts.store_sqlite import SqliteRolloutStore
from traffic.windows import RequestFigures, VersionWindows

ALIAS = "chat"
BASELINE = f"{ALIAS}@aaaaaaaa"
CANDIDATE = f"{ALIAS}@bbbbbbbb"
START = 1_800_000_000.0


@dataclass(frozen=True)
class Behaviour:
    """How a version's requests turn out (each figure drawn per request)."""

    ttft_median_s: float = 0.2
    itl_median_s: float = 0.02
    sigma: float = 0.5
    """Lognormal spread of both latencies."""
    error_rate: float = 0.0
    output_tokens: int = 100
    length_share: float = 0.1
    """Share of requests that end on ``length`` (the rest ``stop``)."""
    block_rate: float = 0.0
    """Share of requests a moderation BLOCK cuts."""
    usd_per_hour: float = 3.6
    answer: str = "the capital of france is paris"
    """What it answers a golden prompt or a shadowed request (None: garbage per request)."""


class Clock:
    def __init__(self, start: float = START) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now


class RecordingTraffic:
    """``TrafficControl`` in memory: the policies put, the audit entries, the drained versions."""

    def __init__(self) -> None:
        self.policies: dict[str, dict[str, Any]] = {}
        self.history: list[dict[str, Any]] = []
        self.audits: list[tuple[str, str, dict[str, Any]]] = []
        self.drained: list[str] = []

    async def policy(self, alias: str) -> dict[str, Any] | None:
        return self.policies.get(alias)

    async def put_policy(
        self, alias: str, policy: dict[str, Any], *, actor: str, reason: str
    ) -> None:
        self.policies[alias] = policy
        self.history.append(policy)

    async def drain(self, version: str, *, actor: str, reason: str) -> None:
        self.drained.append(version)

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
        self.audits.append((action, actor, after))

    def candidate_share(self, alias: str = ALIAS) -> float:
        """The candidate's weight in the policy in force (percent)."""
        policy = self.policies.get(alias)
        if policy is None:
            return 0.0
        return float(sum(s["weight"] for s in policy["split"] if s["version"] == CANDIDATE))

    def max_candidate_share(self) -> float:
        return max(
            (
                float(sum(s["weight"] for s in p["split"] if s["version"] == CANDIDATE))
                for p in self.history
            ),
            default=0.0,
        )


class ScriptedCompleter:
    """Golden prompts answered per version: a text, or an exception to raise."""

    def __init__(self, answers: Mapping[str, str | Exception]) -> None:
        self.answers = dict(answers)
        self.calls = 0

    async def complete(
        self, version: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int
    ) -> str:
        self.calls += 1
        answer = self.answers[version]
        if isinstance(answer, Exception):
            raise answer
        return answer


class FlakyProvider(WindowsProvider):
    """The in-gateway provider, made to fail while ``down`` (a metrics outage)."""

    down = False

    async def figures(self, version: str, window_s: float, *, shadow: bool = False) -> Any:
        if self.down:
            raise MetricsUnavailable("metrics backend down (simulated)")
        return await super().figures(version, window_s, shadow=shadow)


@dataclass
class Sim:
    """One rollout of ``candidate`` over ``baseline`` (see the module docstring)."""

    tmp_path: Path
    baseline: Behaviour
    candidate: Behaviour
    seed: int = 0
    rps: int = 40
    clock: Clock = field(default_factory=Clock)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.windows = VersionWindows(horizon_s=3600, bucket_s=1, clock=self.clock)
        self.meter = CostMeter(
            [
                WorkerCost("b-0", ALIAS, BASELINE, round(self.baseline.usd_per_hour * 1e6)),
                WorkerCost("c-0", ALIAS, CANDIDATE, round(self.candidate.usd_per_hour * 1e6)),
            ],
            windows_s=(3600.0,),
            clock=self.clock,
        )
        self.provider = FlakyProvider(self.windows, self._cost, self._agreement)
        self.traffic = RecordingTraffic()
        self.completer = ScriptedCompleter(
            {BASELINE: self.baseline.answer, CANDIDATE: self.candidate.answer}
        )
        self.store = SqliteRolloutStore(self.tmp_path / "rollouts.db")
        self.lease = SqliteLease(self.tmp_path / "lease.db", clock=self.clock)
        self.shadow_compared = 0
        self.shadow_agreed = 0
        self.controller = self.new_controller("gw-a")

    def new_controller(self, holder: str) -> RolloutController:
        return RolloutController(
            self.store,
            self.lease,
            self.provider,
            self.traffic,
            self.completer,
            holder=holder,
            clock=self.clock,
            reports_dir=None,
        )

    async def start(self, spec: RolloutSpec) -> str:
        await self.store.start()
        await self.lease.start()
        spec = spec.with_gates(gates_for(spec, cost=True))
        rollout = Rollout("ro_sim", spec, self.clock.now, "admin-test", "simulated")
        begin(rollout, self.clock.now, "admin-test")
        await self.store.create(rollout.to_dict())
        assert await self.controller.renew_lease() is not None
        return rollout.rollout_id

    async def aclose(self) -> None:
        await self.lease.aclose()
        await self.store.aclose()

    async def rollout(self) -> Rollout:
        record = await self.store.get("ro_sim")
        assert record is not None
        return Rollout.from_dict(record)

    async def run(self, seconds: float, until: Callable[[Rollout], bool] | None = None) -> Rollout:
        """Simulate up to ``seconds`` of traffic, one controller pass a second (four in the
        first second of each, so a quality check's task is picked up)."""
        for _ in range(math.ceil(seconds)):
            self.clock.now += 1
            self._traffic_second()
            await self.controller.run_once()
            rollout = await self.rollout()
            if until is not None and until(rollout):
                return rollout
            if not rollout.status.active and rollout.policy_applied:
                return rollout
        return await self.rollout()

    def _traffic_second(self) -> None:
        policy = self.traffic.policies.get(ALIAS)
        share = self.traffic.candidate_share() / 100
        shadow = None if policy is None else policy.get("shadow")
        for _ in range(self.rps):
            on_candidate = self.rng.random() < share
            behaviour = self.candidate if on_candidate else self.baseline
            version = CANDIDATE if on_candidate else BASELINE
            self._serve(version, behaviour, worker="c-0" if on_candidate else "b-0")
            if shadow is not None and self.rng.random() * 100 < shadow["percent"]:
                self._shadow_copy()

    def _serve(self, version: str, behaviour: Behaviour, worker: str) -> None:
        rng = self.rng
        if rng.random() < behaviour.error_rate:
            figures = RequestFigures(None, None, 0.05, "engine_error", 0, None, None)
        else:
            ttft = behaviour.ttft_median_s * math.exp(rng.gauss(0, behaviour.sigma))
            itl = behaviour.itl_median_s * math.exp(rng.gauss(0, behaviour.sigma))
            tokens = max(1, round(rng.gauss(behaviour.output_tokens, behaviour.output_tokens / 5)))
            finish = "length" if rng.random() < behaviour.length_share else "stop"
            blocked = rng.random() < behaviour.block_rate
            figures = RequestFigures(
                ttft, itl, ttft + itl * tokens, None, tokens, finish, "block" if blocked else None
            )
        self.windows.observe(version, figures)
        busy_s = min(figures.e2e_s, 1.0) / 4  # four requests share the engine at once
        self.meter.observe_busy(worker, busy_s, busy_s)
        self.meter.observe_tokens(ALIAS, version, 100 + figures.output_tokens, 0)

    def _shadow_copy(self) -> None:
        agrees = compare(
            "shadow", self.baseline.answer, self.candidate.answer, QualityCheck()
        ).agrees
        self.shadow_compared += 1
        self.shadow_agreed += agrees
        self.windows.observe(
            CANDIDATE,
            RequestFigures(0.3, None, 0.3, None, 50, "stop", None, shadow=True),
        )

    def _cost(self, version: str, window_s: float) -> CostFigure | None:
        figures = [
            f for f in self.meter.snapshot(windows_s=[window_s]) if f.model_version == version
        ]
        return figures[0] if figures else None

    def _agreement(self, version: str, window_s: float) -> tuple[int, int]:
        # Every copy so far: the sim's shadow phase is its first phase with copies.
        return self.shadow_compared, self.shadow_agreed


def status_of(rollout: Rollout) -> Status:
    return rollout.status


def events(rollout: Rollout) -> list[str]:
    return [decision.event for decision in rollout.decisions]
