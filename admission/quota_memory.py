"""The in-process quota store: one gateway, no shared state, the semantics of ``admission.quota``.

Also home of the bucket arithmetic both stores share once the levels are known (the snapshot
and the choice of denial), so the Redis store's Lua script only has to return raw levels.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from admission.plans import QuotaLimits
from admission.quota import (
    Denial,
    LimitKind,
    QuotaSnapshot,
    Reservation,
    check_reserve_args,
    check_used_tokens,
)
from core.ids import random_hex

SECONDS_PER_MINUTE = 60.0


def refill_wait_s(level: float, need: float, capacity: int) -> float | None:
    """Seconds until a bucket of ``capacity`` per minute holds ``need``: 0 when it already does,
    ``None`` when it never will (``need`` above the capacity, or a zero-capacity bucket)."""
    if level >= need:
        return 0.0
    if need > capacity or capacity == 0:
        return None
    return (need - level) * SECONDS_PER_MINUTE / capacity


def snapshot_from_levels(
    limits: QuotaLimits, token_level: float, request_level: float, concurrent: int
) -> QuotaSnapshot:
    """The header view of raw bucket levels (levels of unlimited buckets are ignored)."""
    return QuotaSnapshot(
        limit_requests=limits.rpm,
        remaining_requests=_remaining(limits.rpm, request_level),
        reset_requests_s=_reset_s(limits.rpm, request_level),
        limit_tokens=limits.tpm,
        remaining_tokens=_remaining(limits.tpm, token_level),
        reset_tokens_s=_reset_s(limits.tpm, token_level),
        concurrent=concurrent,
    )


def pick_denial(
    failures: list[tuple[LimitKind, float | None]], snapshot: QuotaSnapshot
) -> Denial | None:
    """The denial for the failed limits, or ``None`` when none failed.

    The longest wait wins, since the reservation needs every limit to pass at once; ``None``
    (never) is longer than any wait. Ties go to the first failure, in tokens, requests,
    concurrency order.
    """
    if not failures:
        return None
    limit, retry = max(failures, key=lambda f: math.inf if f[1] is None else f[1])
    return Denial(limit=limit, retry_after_s=retry, snapshot=snapshot)


def _remaining(capacity: int | None, level: float) -> int | None:
    if capacity is None:
        return None
    return max(0, math.floor(level))


def _reset_s(capacity: int | None, level: float) -> float:
    if capacity is None or level >= capacity:
        return 0.0
    return (capacity - level) * SECONDS_PER_MINUTE / capacity


@dataclass(frozen=True, slots=True)
class _Bucket:
    level: float
    at: float

    def level_now(self, capacity: int, now: float) -> float:
        # min() also trims a level left above a capacity that has since been lowered.
        elapsed = max(0.0, now - self.at)
        return min(float(capacity), self.level + elapsed * capacity / SECONDS_PER_MINUTE)


@dataclass(slots=True)
class _Holds:
    """A tenant's concurrency holds, with their expiries also in a heap: dropping the expired
    ones costs what they are, not a scan of every hold (that scan was each reservation's cost:
    512 comparisons with 512 streams of one tenant open)."""

    expiry: dict[str, float] = field(default_factory=dict)
    """Reservation id -> expiry on the store's clock: the holds."""
    _by_expiry: list[tuple[float, str]] = field(default_factory=list)
    """(expiry, reservation id), a heap; entries of released holds stay until popped."""

    def __len__(self) -> int:
        return len(self.expiry)

    def add(self, reservation_id: str, expiry: float) -> None:
        self.expiry[reservation_id] = expiry
        heapq.heappush(self._by_expiry, (expiry, reservation_id))

    def release(self, reservation_id: str) -> None:
        self.expiry.pop(reservation_id, None)
        # Released holds leave their heap entries behind: rebuilt once those outnumber the
        # live ones, so the heap stays within twice the holds.
        if len(self._by_expiry) > 2 * len(self.expiry) + 64:
            self._by_expiry = [(expiry, rid) for rid, expiry in self.expiry.items()]
            heapq.heapify(self._by_expiry)

    def drop_expired(self, now: float) -> None:
        heap = self._by_expiry
        while heap and heap[0][0] <= now:
            expiry, reservation_id = heapq.heappop(heap)
            if self.expiry.get(reservation_id) == expiry:
                del self.expiry[reservation_id]


@dataclass(slots=True)
class _Tenant:
    tokens: _Bucket | None = None
    requests: _Bucket | None = None
    holds: _Holds = field(default_factory=_Holds)


def _level(bucket: _Bucket | None, capacity: int | None, now: float) -> float:
    """A missing bucket is a full one: buckets start full and are only stored once touched."""
    if capacity is None:
        return 0.0
    if bucket is None:
        return float(capacity)
    return bucket.level_now(capacity, now)


class MemoryQuotaStore:
    """``QuotaStore`` in this process. Safe under asyncio because no method awaits between
    reading and writing a tenant's counters."""

    answers_at_once: bool = True

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, hold_s: float
    ) -> Reservation | Denial:
        """Atomically take one request, ``tokens`` tokens and a concurrency hold that expires
        after ``hold_s`` seconds, or nothing."""
        check_reserve_args(tokens, hold_s)
        now = self._clock()
        tenant = self._tenant(tenant_id)
        tenant.holds.drop_expired(now)
        token_level = _level(tenant.tokens, limits.tpm, now)
        request_level = _level(tenant.requests, limits.rpm, now)

        failures: list[tuple[LimitKind, float | None]] = []
        if limits.tpm is not None:
            wait = refill_wait_s(token_level, tokens, limits.tpm)
            if wait != 0.0:
                failures.append((LimitKind.TOKENS, wait))
        if limits.rpm is not None:
            wait = refill_wait_s(request_level, 1, limits.rpm)
            if wait != 0.0:
                failures.append((LimitKind.REQUESTS, wait))
        if limits.max_concurrent is not None and len(tenant.holds) >= limits.max_concurrent:
            wait = _hold_wait_s(list(tenant.holds.expiry.values()), limits.max_concurrent, now)
            failures.append((LimitKind.CONCURRENCY, wait))
        if failures:  # the snapshot is built once: for the denial, or for the reservation
            denial = pick_denial(
                failures,
                snapshot_from_levels(limits, token_level, request_level, len(tenant.holds)),
            )
            if denial is not None:
                return denial

        if limits.tpm is not None:
            token_level -= tokens
            tenant.tokens = _Bucket(token_level, now)
        if limits.rpm is not None:
            request_level -= 1
            tenant.requests = _Bucket(request_level, now)
        # Holds are kept even without a concurrency limit: the snapshot reports them.
        reservation_id = random_hex()
        tenant.holds.add(reservation_id, now + hold_s)
        return Reservation(
            tenant_id=tenant_id,
            reservation_id=reservation_id,
            tokens=tokens,
            snapshot=snapshot_from_levels(limits, token_level, request_level, len(tenant.holds)),
        )

    async def reconcile(
        self, reservation: Reservation, limits: QuotaLimits, used_tokens: int, *, ran: bool = True
    ) -> None:
        """Settle a reservation against real usage and release its concurrency hold; with
        ``ran=False`` also give the request unit back."""
        check_used_tokens(used_tokens)
        now = self._clock()
        tenant = self._tenant(reservation.tenant_id)
        tenant.holds.release(reservation.reservation_id)
        refund = reservation.tokens - used_tokens
        # Settled even when the hold already expired: a long request's real usage still counts.
        if limits.tpm is not None and refund != 0:
            level = min(float(limits.tpm), _level(tenant.tokens, limits.tpm, now) + refund)
            tenant.tokens = _Bucket(level, now)
        if limits.rpm is not None and not ran:
            level = min(float(limits.rpm), _level(tenant.requests, limits.rpm, now) + 1)
            tenant.requests = _Bucket(level, now)

    def _tenant(self, tenant_id: str) -> _Tenant:
        # Not ``setdefault(tenant_id, _Tenant())``: that built (and dropped) a tenant, its
        # holds' dict and heap on every call.
        tenant = self._tenants.get(tenant_id)
        if tenant is None:
            tenant = self._tenants[tenant_id] = _Tenant()
        return tenant

    async def snapshot(self, tenant_id: str, limits: QuotaLimits) -> QuotaSnapshot:
        """The tenant's current state, without taking anything."""
        now = self._clock()
        tenant = self._tenants.get(tenant_id) or _Tenant()
        return snapshot_from_levels(
            limits,
            _level(tenant.tokens, limits.tpm, now),
            _level(tenant.requests, limits.rpm, now),
            sum(1 for expiry in tenant.holds.expiry.values() if expiry > now),
        )

    async def forget(self, tenant_id: str) -> None:
        """Drop every counter of a deleted tenant."""
        self._tenants.pop(tenant_id, None)

    async def aclose(self) -> None:
        """Nothing to release."""


def _hold_wait_s(expiries: list[float], max_concurrent: int, now: float) -> float | None:
    """Until enough live holds expire to leave one slot free (several must go when the limit was
    lowered below the live holds); ``None`` for a zero limit. Reconciles usually free one sooner."""
    if max_concurrent == 0:
        return None
    expiries = sorted(expiries)
    return expiries[len(expiries) - max_concurrent] - now
