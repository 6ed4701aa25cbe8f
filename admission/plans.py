"""What a tenant is allowed: its plan (limits, fairness weight, priority band)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from core.moderation import ModerationPolicy


class PriorityBand(enum.StrEnum):
    """Admission bands, served strictly in this order; fairness applies within a band."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 is served first and shed last."""
        return _BAND_RANK[self]

    @property
    def engine_priority(self) -> int:
        """The ``priority`` vLLM's priority scheduling gets for this band (lower is scheduled
        first, and may preempt higher): interactive work joins the engine's batch ahead of
        standard and batch work, not just ahead of them in the gateway's queue."""
        return _BAND_RANK[self] - _BAND_RANK[PriorityBand.STANDARD]


_BAND_RANK = {PriorityBand.INTERACTIVE: 0, PriorityBand.STANDARD: 1, PriorityBand.BATCH: 2}


@dataclass(frozen=True, slots=True)
class Plan:
    """A tenant's limits. ``None`` means unlimited."""

    tpm: int | None = None
    """Tokens per minute (prompt + output), as a bucket that refills continuously."""
    rpm: int | None = None
    """Requests per minute, as a bucket that refills continuously."""
    max_concurrent: int | None = None
    """Requests of this tenant running or queued at once."""
    max_prompt_tokens: int | None = None
    """Largest prompt one request may send."""
    max_output_tokens: int | None = None
    """Largest ``max_tokens`` one request may ask for (per choice)."""
    weight: float = 1.0
    """Fairness weight: under contention a tenant gets service in proportion to it."""
    band: PriorityBand = PriorityBand.STANDARD
    """Priority band: interactive before standard before batch."""
    moderation: ModerationPolicy | None = None
    """Input and output moderation; ``None`` follows the gateway's default policy."""


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """The part of a plan the quota store enforces atomically."""

    tpm: int | None
    rpm: int | None
    max_concurrent: int | None

    @classmethod
    def of(cls, plan: Plan) -> QuotaLimits:
        return cls(tpm=plan.tpm, rpm=plan.rpm, max_concurrent=plan.max_concurrent)
