"""What a tenant is allowed: its plan (limits, fairness weight, priority band)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from core.moderation import ModerationPolicy


class PriorityBand(enum.StrEnum):
    """Admission bands, served in this order (a waiting band is still served after a bounded
    number of admissions to better ones: ``FairQueueConfig.max_band_skips``); fairness applies
    within a band."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 is served first and shed last."""
        return _BAND_RANK[self]

    def engine_priority(self, position: int = 0) -> int:
        """The ``priority`` vLLM's priority scheduling gets for a request of this band (lower
        is scheduled first; under KV pressure the highest is preempted first): interactive
        -100, standard 0, batch 100, plus the tenant's fair ``position`` in its band when
        admitted (``FairQueue.position``, capped at 99 so bands never overlap). Interactive work
        joins the engine's batch ahead of standard and batch work, and within a band the
        engine favours the tenant most under its fair share."""
        if position < 0:
            raise ValueError(f"engine_priority: position must be >= 0, got {position}")
        offset = _ENGINE_BAND_STEP * (_BAND_RANK[self] - _BAND_RANK[PriorityBand.STANDARD])
        return offset + min(position, _ENGINE_BAND_STEP - 1)


_BAND_RANK = {PriorityBand.INTERACTIVE: 0, PriorityBand.STANDARD: 1, PriorityBand.BATCH: 2}
_ENGINE_BAND_STEP = 100
"""Engine priorities between two bands: positions 0-99 within one."""


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
