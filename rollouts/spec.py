"""What an operator asks of a rollout: the versions, the mode, the steps, the gates and limits.

The JSON shape (the admin API's ``POST /admin/v1/rollouts`` body, and what is stored)::

    {"alias": "chat", "baseline": "chat@1a2b3c4d", "candidate": "chat@5e6f7a8b",
     "mode": "canary",                      # or "ab" (sticky per subject), "shadow_then_canary"
     "steps": [{"weight": 1, "bake_s": 300}, {"weight": 5, "bake_s": 300}, ...],
     "gates": [{"kind": "ttft_p95", "max_ratio": 1.1, "min_samples": 100, ...}],  # [] : defaults
     "interval_s": 30, "inconclusive_limit": 3, "error_limit": 5,
     "shadow_s": 300, "shadow_percent": 100, "shadow_max_in_flight": 4,
     "grace_s": 600, "drain_baseline": true,
     "quality": {"enabled": true, "min_agreement": 0.8, "prompts": [...]},
     "webhook": {"url": "https://ci.example/hooks/tandem", "secret": "..."}}

Every field but ``alias``, ``baseline`` and ``candidate`` has a default. Steps are the
candidate's weights (percent of the alias's traffic, at most one decimal), strictly increasing
and below 100: reaching 100 % is the promotion that follows the last step, so a trailing
``{"weight": 100}`` is accepted and means exactly that. ``spec_from_dict`` raises ``SpecError``
with ``param`` naming the field at fault, which the gateway renders as an OpenAI-shaped 400.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from rollouts.gates import Gate, GateKind, default_gates
from rollouts.quality import QualityCheck
from rollouts.webhook import Webhook

DEFAULT_STEP_WEIGHTS = (1.0, 5.0, 25.0, 50.0)
DEFAULT_BAKE_S = 300.0
"""Five minutes a step: at a few requests a second, enough samples for the latency gates."""

_FIELDS = frozenset(
    {
        "alias",
        "baseline",
        "candidate",
        "mode",
        "steps",
        "gates",
        "interval_s",
        "inconclusive_limit",
        "error_limit",
        "shadow_s",
        "shadow_percent",
        "shadow_max_in_flight",
        "grace_s",
        "drain_baseline",
        "quality",
        "webhook",
    }
)


class Mode(enum.StrEnum):
    """How the candidate's share of traffic is drawn."""

    CANARY = "canary"
    """Each request is drawn by weight."""
    AB = "ab"
    """Each subject (tenant + session or user) keeps its version while the weights stay."""
    SHADOW_THEN_CANARY = "shadow_then_canary"
    """First a shadow phase (the candidate answers copies, never a client), then canary."""


class SpecError(ValueError):
    """A rollout the gateway refuses; ``param`` names the field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True)
class Step:
    """The candidate's weight (percent) and how long it bakes there before the next step."""

    weight: float
    bake_s: float

    @property
    def permille(self) -> int:
        """The weight as the traffic policy keeps it."""
        return int(Decimal(str(self.weight)) * 10)

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight, "bake_s": self.bake_s}


def default_steps(bake_s: float = DEFAULT_BAKE_S) -> tuple[Step, ...]:
    """1 % -> 5 % -> 25 % -> 50 %, ``bake_s`` each (then 100 %)."""
    return tuple(Step(weight, bake_s) for weight in DEFAULT_STEP_WEIGHTS)


@dataclass(frozen=True, slots=True)
class RolloutSpec:
    """One rollout of ``candidate`` over ``baseline`` for ``alias``. Checked on construction."""

    alias: str
    baseline: str
    """Version name (``alias@id8``)."""
    candidate: str
    mode: Mode = Mode.CANARY
    steps: tuple[Step, ...] = field(default_factory=default_steps)
    gates: tuple[Gate, ...] = ()
    """Empty: ``default_gates`` for the mode (and for a gateway with or without a cost meter),
    chosen when the rollout starts."""
    interval_s: float = 30.0
    """How often the gates are measured (every gate alike)."""
    inconclusive_limit: int = 3
    """How many times a step's bake is extended for too few samples before the rollout pauses
    for a person."""
    error_limit: int = 5
    """Measurements in a row the metric source may fail (weight held) before the rollout pauses
    for a person."""
    shadow_s: float = 300.0
    """``shadow_then_canary``: how long the shadow phase bakes."""
    shadow_percent: float = 100.0
    """``shadow_then_canary``: the share of requests copied to the candidate."""
    shadow_max_in_flight: int = 4
    """``shadow_then_canary``: copies in flight at once per gateway (past it they are dropped)."""
    grace_s: float = 600.0
    """After promotion, how long the baseline stays deployed (an abort sends traffic back to it
    at once) before it is drained; at least ``machine.DRAIN_SETTLE_S`` when it is drained."""
    drain_baseline: bool = True
    """After the grace period, undeploy the baseline (its workers stop). False: only its
    traffic ends."""
    quality: QualityCheck = field(default_factory=QualityCheck)
    webhook: Webhook | None = None

    def __post_init__(self) -> None:
        _check(self)

    @property
    def shadow_first(self) -> bool:
        return self.mode is Mode.SHADOW_THEN_CANARY

    def with_gates(self, gates: tuple[Gate, ...]) -> RolloutSpec:
        """The same spec with ``gates`` (the defaults filled in at start)."""
        return _replace(self, gates=gates)

    def to_dict(self, *, reveal_secret: bool = False) -> dict[str, Any]:
        """JSON-able. The webhook's secret is masked unless ``reveal_secret`` (the stored copy
        keeps it: the controller signs with it)."""
        webhook: dict[str, Any] | None = None
        if self.webhook is not None:
            webhook = self.webhook.to_dict()
            if reveal_secret:
                webhook["secret"] = self.webhook.secret
        return {
            "alias": self.alias,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "mode": self.mode.value,
            "steps": [step.to_dict() for step in self.steps],
            "gates": [gate.to_dict() for gate in self.gates],
            "interval_s": self.interval_s,
            "inconclusive_limit": self.inconclusive_limit,
            "error_limit": self.error_limit,
            "shadow_s": self.shadow_s,
            "shadow_percent": self.shadow_percent,
            "shadow_max_in_flight": self.shadow_max_in_flight,
            "grace_s": self.grace_s,
            "drain_baseline": self.drain_baseline,
            "quality": self.quality.to_dict(),
            "webhook": webhook,
        }


def gates_for(spec: RolloutSpec, *, cost: bool) -> tuple[Gate, ...]:
    """The gates the rollout runs with: its own, else the defaults for its mode; a shadow-first
    rollout always judges its shadow phase by agreement, so that gate is added if missing."""
    gates = spec.gates or default_gates(shadow=spec.shadow_first, cost=cost)
    if spec.shadow_first and not any(g.kind is GateKind.SHADOW_AGREEMENT for g in gates):
        gates = (
            *gates,
            *(g for g in default_gates(shadow=True) if g.kind is GateKind.SHADOW_AGREEMENT),
        )
    return gates


SHADOW_PHASE_KINDS = frozenset({GateKind.SHADOW_AGREEMENT, GateKind.ERROR_RATE})
"""What the shadow phase judges: copies are not streamed (their latency is not the client's)
and serve no client (no moderation, no cost per client token), so agreement and errors only."""


def spec_from_dict(data: Mapping[str, Any]) -> RolloutSpec:
    """Parse the JSON shape in the module docstring; ``SpecError`` names the field at fault."""
    if not isinstance(data, Mapping):
        raise SpecError("rollout", "the rollout must be a JSON object")
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise SpecError(unknown[0], f"unknown field {unknown[0]!r}; known: {sorted(_FIELDS)}")
    fields: dict[str, Any] = {}
    for name in ("alias", "baseline", "candidate"):
        value = data.get(name)
        if not isinstance(value, str) or not value:
            what = "the model name clients use" if name == "alias" else "a version's name"
            raise SpecError(name, f"{name} is required: {what}")
        fields[name] = value
    if "mode" in data:
        try:
            fields["mode"] = Mode(data["mode"])
        except ValueError:
            modes = ", ".join(mode.value for mode in Mode)
            raise SpecError("mode", f"mode must be one of: {modes}") from None
    if "steps" in data:
        fields["steps"] = _steps(data["steps"])
    if "gates" in data:
        raw = data["gates"]
        if not isinstance(raw, list):
            raise SpecError("gates", "gates must be a list of gate objects ([] for the defaults)")
        gates = []
        for i, item in enumerate(raw):
            try:
                gates.append(Gate.from_dict(item))
            except (ValueError, TypeError) as exc:
                raise SpecError(f"gates[{i}]", str(exc)) from None
        fields["gates"] = tuple(gates)
    for name in ("interval_s", "shadow_s", "shadow_percent", "grace_s"):
        if name in data:
            fields[name] = _number(data[name], name)
    for name in ("inconclusive_limit", "error_limit", "shadow_max_in_flight"):
        if name in data:
            value = data[name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(name, f"{name} must be a whole number")
            fields[name] = value
    if "drain_baseline" in data:
        if not isinstance(data["drain_baseline"], bool):
            raise SpecError("drain_baseline", "drain_baseline must be true or false")
        fields["drain_baseline"] = data["drain_baseline"]
    if data.get("quality") is not None:
        try:
            fields["quality"] = QualityCheck.from_dict(data["quality"])
        except (ValueError, TypeError) as exc:
            raise SpecError("quality", str(exc)) from None
    if data.get("webhook") is not None:
        try:
            fields["webhook"] = Webhook.from_dict(data["webhook"])
        except (ValueError, TypeError) as exc:
            raise SpecError("webhook", str(exc)) from None
    try:
        return RolloutSpec(**fields)
    except SpecError:
        raise
    except ValueError as exc:
        raise SpecError("rollout", str(exc)) from None


def _steps(raw: Any) -> tuple[Step, ...]:
    if not isinstance(raw, list) or not raw:
        raise SpecError("steps", "steps must be a non-empty list of {weight, bake_s}")
    steps = []
    for i, item in enumerate(raw):
        param = f"steps[{i}]"
        if not isinstance(item, Mapping) or set(item) - {"weight", "bake_s"}:
            raise SpecError(param, f"{param} must be an object {{weight, bake_s}}")
        weight = _number(item.get("weight"), f"{param}.weight")
        bake_s = _number(item.get("bake_s", DEFAULT_BAKE_S), f"{param}.bake_s")
        if weight == 100 and i == len(raw) - 1 and i > 0:
            break  # the promotion, which follows the last step anyway
        steps.append(Step(weight, bake_s))
    return tuple(steps)


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SpecError(param, f"{param} must be a number")
    return float(value)


def _check(spec: RolloutSpec) -> None:
    if spec.baseline == spec.candidate:
        raise SpecError("candidate", "the candidate must be another version than the baseline")
    for name in ("baseline", "candidate"):
        version = getattr(spec, name)
        if version.rpartition("@")[0] != spec.alias:
            raise SpecError(name, f"{name} {version!r} is not a version of {spec.alias!r}")
    if not spec.steps:
        raise SpecError("steps", "a rollout needs at least one step")
    previous = 0.0
    for i, step in enumerate(spec.steps):
        param = f"steps[{i}]"
        if not 0 < step.weight < 100:
            raise SpecError(
                f"{param}.weight",
                f"{param}.weight must be above 0 and below 100 "
                "(100 % is the promotion after the last step)",
            )
        if Decimal(str(step.weight)) * 10 % 1 != 0:
            raise SpecError(f"{param}.weight", f"{param}.weight: at most one decimal (0.1 %)")
        if step.weight <= previous:
            raise SpecError(f"{param}.weight", "step weights must increase")
        if not step.bake_s > 0:
            raise SpecError(f"{param}.bake_s", f"{param}.bake_s must be more than 0 seconds")
        previous = step.weight
    for name in ("interval_s", "shadow_s"):
        if not getattr(spec, name) > 0:
            raise SpecError(name, f"{name} must be more than 0 seconds")
    if not spec.grace_s >= 0:
        raise SpecError("grace_s", "grace_s must be 0 seconds or more")
    if not 0 < spec.shadow_percent <= 100:
        raise SpecError("shadow_percent", "shadow_percent must be above 0 and at most 100")
    for name in ("inconclusive_limit", "error_limit", "shadow_max_in_flight"):
        if getattr(spec, name) < 1:
            raise SpecError(name, f"{name} must be at least 1")
    kinds = [gate.kind for gate in spec.gates]
    if len(set(kinds)) != len(kinds):
        raise SpecError("gates", "one gate per kind: merge the duplicates")
    if GateKind.SHADOW_AGREEMENT in kinds and not spec.shadow_first:
        raise SpecError("gates", "a shadow_agreement gate needs mode 'shadow_then_canary'")


def _replace(spec: RolloutSpec, **changes: Any) -> RolloutSpec:
    values = {name: getattr(spec, name) for name in RolloutSpec.__dataclass_fields__}
    values.update(changes)
    return RolloutSpec(**values)
