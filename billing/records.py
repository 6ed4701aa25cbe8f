"""The ledger's unit: one frozen ``UsageRecord`` per billed request.

A record is written once and never changed. Its ``record_id`` is the ledger's primary key:
the request id, or for a request sent with an ``Idempotency-Key`` an id derived from the key,
so a retry that runs again after a gateway restart cannot bill the same request twice. Money is
integer micro-units of the record's currency; times are integer Unix microseconds (UTC), so a
record serialises to the same bytes on every machine.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

MICROS_PER_UNIT = 1_000_000
"""Micro-units per currency unit (1 USD = 1,000,000 micros)."""


class RequestStatus(enum.StrEnum):
    """How the billed request ended (``core.request.RequestPhase``'s terminal phases)."""

    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One billed request, as the ledger stores and exports it."""

    record_id: str
    """Primary key: the request id, or ``idempotent_record_id(...)`` for idempotent requests."""
    request_id: str
    """The id the client saw (``x-request-id``)."""
    tenant_id: str
    key_id: str | None
    """The API key used; None for the anonymous tenant."""
    model: str
    """The model name the client asked for."""
    model_version: str
    """The exact weights served (what price cards and measured cost are keyed by)."""
    deployment: str
    """The deployment (rollout arm) that served it."""
    endpoint: str
    """``chat`` or ``completions``."""
    path: str | None
    """``disaggregated``, ``colocated`` or ``fallback``; None when no worker was reached."""
    status: RequestStatus
    finish_reason: str | None
    error_code: str | None
    moderation_action: str | None
    """The strictest moderation action taken (``flag``, ``redact``, ``block``), if any."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    """Prompt tokens served from the engine's prefix cache (a subset of ``prompt_tokens``)."""
    ttft_us: int | None
    e2e_us: int | None
    started_at_us: int
    finished_at_us: int
    """When the request ended: the time it is billed at (periods and months go by it)."""
    cost_micros: int
    price_effective_from_us: int | None
    """``effective_from_us`` of the price card that priced it; None: no card (cost 0)."""
    currency: str

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_micros"):
            if getattr(self, name) < 0:
                raise ValueError(f"UsageRecord.{name} must not be negative")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError("UsageRecord.cached_tokens cannot exceed prompt_tokens")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain values in ``COLUMNS`` order (the status as its string). Every field is a
        scalar: no ``dataclasses.asdict``, which deep-copies each one (3-4 % of the
        gateway's CPU per request in a ``bench/overhead`` profile)."""
        row = {name: getattr(self, name) for name in COLUMNS}
        row["status"] = self.status.value
        return row

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> UsageRecord:
        """The inverse of ``to_dict`` (extra keys are ignored, for forward compatibility)."""
        values: dict[str, Any] = {name: row.get(name) for name in COLUMNS}
        values["status"] = RequestStatus(values["status"])
        return cls(**values)


COLUMNS: tuple[str, ...] = tuple(field.name for field in fields(UsageRecord))
"""Column order of the ledger table and of every per-request export."""


def idempotent_record_id(tenant_id: str, endpoint: str, idempotency_key: str) -> str:
    """The record id of a request with an ``Idempotency-Key``: the same for every run of it."""
    digest = hashlib.sha256(f"{tenant_id}\0{endpoint}\0{idempotency_key}".encode()).hexdigest()
    return f"idem-{digest[:40]}"


def to_unix_us(moment: datetime) -> int:
    """Integer Unix microseconds of an aware datetime."""
    if moment.tzinfo is None:
        raise ValueError("use a timezone-aware datetime (UTC)")
    delta = moment - EPOCH
    return (delta.days * 86_400 + delta.seconds) * MICROS_PER_UNIT + delta.microseconds


def from_unix_us(micros: int) -> datetime:
    """The UTC datetime of integer Unix microseconds."""
    return datetime.fromtimestamp(micros // MICROS_PER_UNIT, UTC).replace(
        microsecond=micros % MICROS_PER_UNIT
    )


def format_unix_us(micros: int) -> str:
    """RFC 3339 in UTC with microseconds, e.g. ``2026-11-22T10:00:00.000123Z``."""
    return from_unix_us(micros).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
