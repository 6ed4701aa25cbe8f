"""Token quotas: reserve before admission, reconcile after, in one round trip to the store.

Semantics (the in-memory store and the Redis Lua script implement exactly these):

- TPM and RPM are token buckets of capacity ``tpm`` (``rpm``) refilling continuously at
  ``tpm / 60`` per second, starting full. Concurrency is a set of holds, each with an expiry,
  so a gateway that dies cannot leak a slot for longer than its hold.
- ``reserve(tokens)`` is all-or-nothing: one request unit from the RPM bucket, ``tokens`` from the
  TPM bucket and one concurrency hold, or nothing and a ``Denial`` saying which limit and how long
  until it would pass (the longest wait among the limits that failed).
- A request larger than the TPM capacity can never pass: ``Denial(retry_after_s=None)``.
- ``reconcile(used)`` returns ``reserved - used`` to the TPM bucket (capped at capacity; it may
  go below zero when the engine used more than estimated, so the debt is paid by later requests)
  and drops the concurrency hold. The request unit comes back only when the request never
  reached an engine (``ran=False``: shed, deadline, client gone while queued); otherwise the
  request happened and counts.
- Clock: the store's own (Redis ``TIME``), so replicas with skewed clocks agree.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from admission.plans import QuotaLimits


class LimitKind(enum.StrEnum):
    """Which limit refused a reservation."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENCY = "concurrency"


@dataclass(frozen=True, slots=True)
class QuotaSnapshot:
    """A tenant's quota state as the ``x-ratelimit-*`` headers show it. ``None`` = unlimited."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float
    """Seconds until the request bucket is full again."""
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float
    """Seconds until the token bucket is full again."""
    concurrent: int
    """Unexpired concurrency holds."""


@dataclass(frozen=True, slots=True)
class Reservation:
    """Granted: what was taken, to be reconciled exactly once when the request ends."""

    tenant_id: str
    reservation_id: str
    tokens: int
    snapshot: QuotaSnapshot


@dataclass(frozen=True, slots=True)
class Denial:
    """Refused: nothing was taken."""

    limit: LimitKind
    retry_after_s: float | None
    """Seconds until the same reservation would pass; ``None`` = never (larger than the plan)."""
    snapshot: QuotaSnapshot


class QuotaStore(Protocol):
    """Where quota counters live: in memory (one gateway) or in Redis (shared by replicas).

    Every method raises ``StoreUnavailable`` when the store cannot be reached.
    """

    answers_at_once: bool
    """True when no call ever suspends (the counters live in this process): a cancellation
    then cannot land between the store taking a reservation and its caller hearing of it."""

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, hold_s: float
    ) -> Reservation | Denial:
        """Atomically take one request, ``tokens`` tokens and a concurrency hold that expires
        after ``hold_s`` seconds, or nothing."""
        ...

    async def reconcile(
        self, reservation: Reservation, limits: QuotaLimits, used_tokens: int, *, ran: bool = True
    ) -> None:
        """Settle a reservation against real usage and release its concurrency hold; with
        ``ran=False`` also give the request unit back."""
        ...

    async def snapshot(self, tenant_id: str, limits: QuotaLimits) -> QuotaSnapshot:
        """The tenant's current state, without taking anything."""
        ...

    async def forget(self, tenant_id: str) -> None:
        """Drop every counter of a deleted tenant."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def check_reserve_args(tokens: int, hold_s: float) -> None:
    """The arguments every store's ``reserve`` refuses (a caller's bug, not a client error)."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if hold_s <= 0:
        raise ValueError(f"hold_s must be > 0, got {hold_s}")


def check_used_tokens(used_tokens: int) -> None:
    """What every store's ``reconcile`` refuses."""
    if used_tokens < 0:
        raise ValueError(f"used_tokens must be >= 0, got {used_tokens}")


class StoreUnavailable(Exception):
    """The store could not be reached or did not answer in time (callers apply the
    fail-open / fail-closed policy)."""
