"""What a run sends: the target endpoint, the tenants' mix, and the planned requests.

A plan is built up front from the seed (prompts, tenants, arrival times), so two runs with the
same seed send the same requests in the same order at the same offsets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.harness.dataset import LengthDistribution, Prompt


class Api(enum.StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self is Api.CHAT else "/v1/completions"


@dataclass(frozen=True, slots=True)
class Target:
    base_url: str
    """Server root, e.g. ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted)."""
    model: str
    api: Api = Api.CHAT
    timeout_s: float = 600.0
    ignore_eos: bool = False
    """vLLM's ``ignore_eos``: every request produces exactly ``max_tokens``."""
    extra_body: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        root = self.base_url.rstrip("/").removesuffix("/v1")
        return root + self.api.path


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One simulated tenant of a multi-tenant mix."""

    name: str
    share: float = 1.0
    """Relative share of the requests (normalised over the mix)."""
    api_key: str | None = None
    priority: str | None = None
    """A label reported with the results (Tandem's priority band comes from the tenant's plan)."""
    input_len: LengthDistribution | None = None
    output_len: LengthDistribution | None = None
    """Overrides of the run's length distributions for this tenant."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TenantSpec:
        known = {"name", "share", "api_key", "priority", "input_len", "output_len"}
        unknown = set(raw) - known
        if unknown or "name" not in raw:
            raise ValueError(
                f"tenant {raw!r}: needs 'name'; accepted keys are {sorted(known)}"
                + (f", not {sorted(unknown)}" if unknown else "")
            )
        share = float(raw.get("share", 1.0))
        if share <= 0:
            raise ValueError(f"tenant {raw['name']!r}: share must be > 0, got {share}")

        def dist(key: str) -> LengthDistribution | None:
            return LengthDistribution.parse(raw[key]) if raw.get(key) else None

        return cls(
            name=str(raw["name"]),
            share=share,
            api_key=raw.get("api_key"),
            priority=raw.get("priority"),
            input_len=dist("input_len"),
            output_len=dist("output_len"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "share": self.share,
            "priority": self.priority,
            "input_len": self.input_len.describe() if self.input_len else None,
            "output_len": self.output_len.describe() if self.output_len else None,
            # The key itself stays out of result files.
            "has_api_key": self.api_key is not None,
        }


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    index: int
    tenant: TenantSpec
    prompt: Prompt
    warmup: bool
    scheduled_s: float | None
    """Offset from the run's start (None: closed loop)."""


def assign_tenants(
    tenants: list[TenantSpec], num_requests: int, rng: np.random.Generator
) -> list[TenantSpec]:
    """Each request's tenant, drawn by share (a deterministic sequence for a given seed)."""
    shares = np.array([t.share for t in tenants], dtype=float)
    picks = rng.choice(len(tenants), size=num_requests, p=shares / shares.sum())
    return [tenants[int(i)] for i in picks]
