"""A reference model of the quota semantics (``admission/quota.py``) that judges a store's
answers: what it may grant, what it must grant, and the bound on what it grants.

The store's clock is known to within a ``Bracket``: the caller's clock read just before and just
after the call (the memory store runs on a fake clock, so its brackets are points; Redis uses
its own ``TIME``, the same wall clock as the test's ``time.time()``, so a call's bracket holds
the instant the script ran). The model therefore keeps each bucket's level as an interval,
which refill widens by what the brackets leave open and answers narrow: a grant proves the
level held the tokens, a refusal for tokens proves it did not.

What each answer must satisfy (``TenantModel.reserved``, ``reconciled``, ``snapshot_seen``):

- a grant: every limit could have passed (token and request levels, concurrency holds that are
  surely live below the limit); a refusal: the limit it names could have failed, and some limit
  could have (no refusal while every limit surely passes); its wait matches the level.
- **the bound** (docs/ARCHITECTURE.md, "Tenants, quotas and fairness"): over any stretch of
  the store's clock that ends with a grant, the tokens granted minus the tokens given back in
  it are at most ``tpm + tpm / 60 x its length`` (requests alike with ``rpm``); an overrun
  (used above reserved) counts as tokens taken;
- each reservation is settled at most once; a snapshot's live holds are those not settled
  whose expiry has not passed: no hold outlives its expiry, none ends before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from admission.plans import QuotaLimits
from admission.quota import Denial, LimitKind, QuotaSnapshot, Reservation

EPS = 1e-6
"""Float slack on levels and waits (token counts are whole; refill is a float)."""


@dataclass(frozen=True, slots=True)
class Bracket:
    """The store's clock during one call lay within ``[lo, hi]``."""

    lo: float
    hi: float

    def later(self, seconds: float) -> Bracket:
        return Bracket(self.lo + seconds, self.hi + seconds)


class Bucket:
    """A token bucket of ``capacity`` per minute whose level is known to lie in ``[lo, hi]``
    right after the call of bracket ``at`` (untouched: full, like the stores' missing keys)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lo = self.hi = float(capacity)
        self.at: Bracket | None = None

    def level(self, when: Bracket) -> tuple[float, float]:
        """The level's bounds during the call of bracket ``when``."""
        if self.at is None:
            return self.lo, self.hi
        rate = self.capacity / 60
        least = max(0.0, when.lo - self.at.hi) * rate
        most = max(0.0, when.hi - self.at.lo) * rate
        cap = float(self.capacity)
        return min(cap, self.lo + least), min(cap, self.hi + most)

    def took(self, need: float, when: Bracket) -> None:
        """A grant of ``need``: the level held it, and lost it."""
        lo, hi = self.level(when)
        self._set(max(lo, need) - need, hi - need, when)

    def lacked(self, need: float, when: Bracket) -> None:
        """A refusal for this bucket: the level was below ``need``."""
        lo, hi = self.level(when)
        self._set(lo, min(hi, need), when)

    def refunded(self, amount: float, when: Bracket) -> None:
        """``amount`` given back (negative: charged), capped at the capacity."""
        lo, hi = self.level(when)
        cap = float(self.capacity)
        self._set(min(cap, lo + amount), min(cap, hi + amount), when)

    def _set(self, lo: float, hi: float, when: Bracket) -> None:
        assert lo <= hi + EPS, f"bucket model out of order: [{lo}, {hi}]"
        self.lo, self.hi, self.at = lo, hi, when


@dataclass(slots=True)
class Hold:
    """A concurrency hold: live from its grant until settled or past its expiry."""

    expiry: Bracket
    settled: bool = False

    def surely_live(self, when: Bracket) -> bool:
        return not self.settled and self.expiry.lo > when.hi

    def maybe_live(self, when: Bracket) -> bool:
        return not self.settled and self.expiry.hi > when.lo


@dataclass(frozen=True, slots=True)
class Movement:
    """One change of a bucket the bound counts: ``taken`` by a grant, ``returned`` by a
    reconcile (negative for an overrun)."""

    at: Bracket
    taken: int = 0
    returned: int = 0


def check_bound(movements: list[Movement], capacity: int, what: str) -> float:
    """The bound, for every stretch ending with the last movement (a grant): a full bucket at
    its start, plus the refill over its longest possible length. Returns how close the
    closest stretch came (net / bound)."""
    end = movements[-1].at.hi
    net = 0
    closest = 0.0
    for movement in reversed(movements):
        net += movement.taken - movement.returned
        allowed = capacity + capacity / 60 * max(0.0, end - movement.at.lo)
        closest = max(closest, net / allowed)
        assert net <= allowed + EPS, (
            f"{what}: {net} granted net of refunds over a stretch of at most "
            f"{end - movement.at.lo:.6f} s, more than the bound {allowed:.3f} (capacity "
            f"{capacity} + refill)"
        )
    return closest


@dataclass
class TenantModel:
    """What one tenant's quota may look like, given every answer the store gave so far."""

    limits: QuotaLimits
    tokens: Bucket | None = field(init=False)
    requests: Bucket | None = field(init=False)
    holds: dict[str, Hold] = field(default_factory=dict)
    token_movements: list[Movement] = field(default_factory=list)
    request_movements: list[Movement] = field(default_factory=list)
    closest_to_bound: float = 0.0
    """The largest share of the bound any stretch used (tokens or requests)."""

    def __post_init__(self) -> None:
        self.tokens = None if self.limits.tpm is None else Bucket(self.limits.tpm)
        self.requests = None if self.limits.rpm is None else Bucket(self.limits.rpm)

    def live(self, when: Bracket) -> tuple[int, int]:
        """Holds surely live and maybe live during ``when``."""
        holds = self.holds.values()
        return sum(h.surely_live(when) for h in holds), sum(h.maybe_live(when) for h in holds)

    def reserved(
        self, tokens: int, hold_s: float, when: Bracket, answer: Reservation | Denial
    ) -> None:
        """Judge one ``reserve`` answer, then learn from it."""
        t_lo, t_hi = self.tokens.level(when) if self.tokens else (math.inf, math.inf)
        r_lo, r_hi = self.requests.level(when) if self.requests else (math.inf, math.inf)
        surely, maybe = self.live(when)
        max_concurrent = self.limits.max_concurrent
        if isinstance(answer, Reservation):
            assert t_hi >= tokens - EPS, f"granted {tokens} tokens with at most {t_hi} left"
            assert r_hi >= 1 - EPS, f"granted a request with at most {r_hi} left"
            assert max_concurrent is None or surely < max_concurrent, (
                f"granted a hold with {surely} live holds of {max_concurrent}"
            )
            assert answer.tokens == tokens and answer.reservation_id not in self.holds
            self.holds[answer.reservation_id] = Hold(when.later(hold_s))
            if self.tokens is not None:
                self.tokens.took(tokens, when)
                self.token_movements.append(Movement(when, taken=tokens))
                closest = check_bound(self.token_movements, self.tokens.capacity, "tokens")
                self.closest_to_bound = max(self.closest_to_bound, closest)
            if self.requests is not None:
                self.requests.took(1, when)
                self.request_movements.append(Movement(when, taken=1))
                closest = check_bound(self.request_movements, self.requests.capacity, "requests")
                self.closest_to_bound = max(self.closest_to_bound, closest)
            return
        room = (
            t_lo >= tokens + EPS
            and r_lo >= 1 + EPS
            and (max_concurrent is None or maybe < max_concurrent)
        )
        assert not room, (
            f"refused ({answer.limit}) with every limit passing: tokens >= {t_lo} of {tokens}, "
            f"requests >= {r_lo}, at most {maybe} live holds of {max_concurrent}"
        )
        if answer.limit is LimitKind.TOKENS:
            assert self.tokens is not None and t_lo < tokens + EPS
            self._check_wait(answer, tokens, t_lo, t_hi, self.tokens.capacity)
            self.tokens.lacked(tokens, when)
        elif answer.limit is LimitKind.REQUESTS:
            assert self.requests is not None and r_lo < 1 + EPS
            self._check_wait(answer, 1, r_lo, r_hi, self.requests.capacity)
            self.requests.lacked(1, when)
        else:
            assert max_concurrent is not None and maybe >= max_concurrent, (
                f"refused for concurrency with at most {maybe} live holds of {max_concurrent}"
            )

    def reconciled(self, reservation: Reservation, used: int, ran: bool, when: Bracket) -> None:
        """Learn from one ``reconcile`` the store carried out."""
        hold = self.holds[reservation.reservation_id]
        assert not hold.settled, f"reservation {reservation.reservation_id} settled twice"
        hold.settled = True
        refund = reservation.tokens - used
        if self.tokens is not None:
            self.tokens.refunded(refund, when)
            self.token_movements.append(Movement(when, returned=refund))
        if self.requests is not None and not ran:
            self.requests.refunded(1, when)
            self.request_movements.append(Movement(when, returned=1))

    def snapshot_seen(self, snapshot: QuotaSnapshot, when: Bracket) -> None:
        """A snapshot's live holds and remaining units agree with the model."""
        surely, maybe = self.live(when)
        assert surely <= snapshot.concurrent <= maybe, (
            f"{snapshot.concurrent} live holds, expected {surely} to {maybe}: a hold outlived "
            "its expiry or ended before it"
        )
        for bucket, remaining in (
            (self.tokens, snapshot.remaining_tokens),
            (self.requests, snapshot.remaining_requests),
        ):
            if bucket is not None:
                lo, hi = bucket.level(when)
                assert remaining is not None
                least, most = math.floor(max(0.0, lo - EPS)), math.floor(max(0.0, hi + EPS))
                assert least <= remaining <= most, (
                    f"{remaining} remaining, expected {least} to {most}"
                )

    @staticmethod
    def _check_wait(answer: Denial, need: int, lo: float, hi: float, capacity: int) -> None:
        if need > capacity:
            assert answer.retry_after_s is None
            return
        assert answer.retry_after_s is not None
        shortest, longest = (need - hi) * 60 / capacity, (need - lo) * 60 / capacity
        assert shortest - EPS <= answer.retry_after_s <= longest + EPS, (
            f"wait {answer.retry_after_s} s, expected {shortest} to {longest}"
        )
