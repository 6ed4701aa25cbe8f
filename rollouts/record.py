"""A rollout's state: where it is, what it measured, what it decided. Stored as JSON.

``Rollout`` is mutable and has one owner: the controller holding the lease changes it (through
``rollouts.machine``) and saves it with its fencing token; everyone else reads it.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

from rollouts.gates import Measurement
from rollouts.quality import QualityResult
from rollouts.spec import RolloutSpec, spec_from_dict


class Status(enum.StrEnum):
    """Argo's phases of a rollout, as an operator sees them."""

    RUNNING = "running"
    PAUSED = "paused"
    """Held for a person (``resume``, ``promote`` or ``abort``): the weight stays."""
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    """A gate or the quality check failed: rolled back."""
    ABORTED = "aborted"
    """A person aborted it: rolled back."""

    @property
    def active(self) -> bool:
        return self in (Status.RUNNING, Status.PAUSED)


class Phase(enum.StrEnum):
    """What the candidate is doing."""

    QUALITY = "quality"
    """The golden prompts, on both versions, before any client traffic."""
    SHADOW = "shadow"
    """Answering copies of the alias's requests (``shadow_then_canary``)."""
    CANARY = "canary"
    """At ``spec.steps[step_index]``'s weight."""
    GRACE = "grace"
    """Promoted (100 %), the baseline still deployed for ``spec.grace_s``."""
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Decision:
    """One line of the decision log."""

    at: float
    event: str
    """``started``, ``quality_passed``, ``step_passed``, ``step_extended``, ``paused``,
    ``resumed``, ``failed``, ``rolled_back``, ``promoted``, ``aborted``, ``succeeded``,
    ``drained``, ``metrics_error``."""
    detail: str
    weight: float
    """The candidate's weight after the decision (percent)."""
    actor: str = ""
    """Who decided: the controller (``rollout``) or an admin key's id."""
    measurements: tuple[dict[str, Any], ...] = ()
    """Every gate's latest measurement (``Measurement.to_dict``) when gates decided."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "event": self.event,
            "detail": self.detail,
            "weight": self.weight,
            "actor": self.actor,
            "measurements": list(self.measurements),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        return cls(
            at=data["at"],
            event=data["event"],
            detail=data["detail"],
            weight=data["weight"],
            actor=data.get("actor", ""),
            measurements=tuple(data.get("measurements", ())),
        )


def new_rollout_id() -> str:
    return f"ro_{secrets.token_hex(8)}"


@dataclass(slots=True)
class Rollout:
    """A rollout and its progress."""

    rollout_id: str
    spec: RolloutSpec
    """With its gates filled in at start."""
    created_at: float
    created_by: str
    reason: str
    status: Status = Status.RUNNING
    phase: Phase = Phase.QUALITY
    step_index: int = 0
    """The step in force while the phase is ``canary``."""
    phase_started_at: float = 0.0
    """When the phase (or the step) began: the start of the window the gates read."""
    weight: float = 0.0
    """The candidate's weight the rollout wants in force (percent)."""
    extensions: int = 0
    """Times the current step's bake was extended for too few samples."""
    consecutive_errors: int = 0
    """Measurements in a row the metric source failed."""
    last_measured_at: float | None = None
    history: list[Measurement] = field(default_factory=list)
    """The current phase's measurements, oldest first (what ``assess`` folds)."""
    quality: QualityResult | None = None
    decisions: list[Decision] = field(default_factory=list)
    weights: list[tuple[float, float]] = field(default_factory=list)
    """(time, candidate weight) each time it changed."""
    paused_reason: str | None = None
    last_command_seq: int = 0
    """The last operator command applied (``RolloutStore.commands``)."""
    policy_applied: bool = False
    """Whether the traffic policy for ``weight`` is known to be in force."""
    announced: int = 0
    """How many decisions were audited and sent to the webhook."""
    report: list[str] = field(default_factory=list)
    """The report's files, once finished."""
    updated_at: float = 0.0

    @property
    def alias(self) -> str:
        return self.spec.alias

    @property
    def step_deadline(self) -> float:
        """When the current phase's bake ends (extended once per inconclusive extension)."""
        return self.phase_started_at + self.step_bake_s * (1 + self.extensions)

    @property
    def step_bake_s(self) -> float:
        if self.phase is Phase.CANARY:
            return self.spec.steps[self.step_index].bake_s
        if self.phase is Phase.SHADOW:
            return self.spec.shadow_s
        if self.phase is Phase.GRACE:
            return self.spec.grace_s
        return 0.0

    def to_dict(self) -> dict[str, Any]:
        """What the store keeps (the webhook secret included)."""
        return {
            "id": self.rollout_id,
            "alias": self.alias,
            "spec": self.spec.to_dict(reveal_secret=True),
            "created_at": self.created_at,
            "created_by": self.created_by,
            "reason": self.reason,
            "status": self.status.value,
            "phase": self.phase.value,
            "step_index": self.step_index,
            "phase_started_at": self.phase_started_at,
            "weight": self.weight,
            "extensions": self.extensions,
            "consecutive_errors": self.consecutive_errors,
            "last_measured_at": self.last_measured_at,
            "history": [measurement.to_dict() for measurement in self.history],
            "quality": None if self.quality is None else self.quality.to_dict(),
            "decisions": [decision.to_dict() for decision in self.decisions],
            "weights": [list(point) for point in self.weights],
            "paused_reason": self.paused_reason,
            "last_command_seq": self.last_command_seq,
            "policy_applied": self.policy_applied,
            "announced": self.announced,
            "report": list(self.report),
            "updated_at": self.updated_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rollout:
        quality = data.get("quality")
        return cls(
            rollout_id=data["id"],
            spec=spec_from_dict(data["spec"]),
            created_at=data["created_at"],
            created_by=data["created_by"],
            reason=data["reason"],
            status=Status(data["status"]),
            phase=Phase(data["phase"]),
            step_index=data["step_index"],
            phase_started_at=data["phase_started_at"],
            weight=data["weight"],
            extensions=data["extensions"],
            consecutive_errors=data["consecutive_errors"],
            last_measured_at=data["last_measured_at"],
            history=[Measurement.from_dict(item) for item in data["history"]],
            quality=None if quality is None else QualityResult.from_dict(quality),
            decisions=[Decision.from_dict(item) for item in data["decisions"]],
            weights=[(at, weight) for at, weight in data["weights"]],
            paused_reason=data["paused_reason"],
            last_command_seq=data["last_command_seq"],
            policy_applied=data["policy_applied"],
            announced=data["announced"],
            report=list(data.get("report", ())),
            updated_at=data["updated_at"],
        )

    def public_dict(self) -> dict[str, Any]:
        """What the admin API shows: the stored shape, the webhook secret masked, and the
        current step spelled out."""
        shown = self.to_dict()
        shown["spec"] = self.spec.to_dict()
        step = None
        if self.phase is Phase.CANARY:
            step = {
                "index": self.step_index,
                "of": len(self.spec.steps),
                "weight": self.spec.steps[self.step_index].weight,
                "bake_s": self.spec.steps[self.step_index].bake_s,
            }
        shown["step"] = step
        shown["phase_ends_at"] = (
            self.step_deadline if self.phase in (Phase.SHADOW, Phase.CANARY) else None
        )
        if self.phase is Phase.GRACE:
            shown["phase_ends_at"] = self.phase_started_at + self.spec.grace_s
        return shown
