"""Failed authentications slowed per client, so guessing keys (or flooding the key store with
lookups of made-up ones) costs the guesser time and the store nothing.

A token bucket per client address (``gateway/client_address.py``) holds ``max_failures``
failed authentications and refills one every ``window_s / max_failures``: a client may fail
``max_failures`` times in a burst, then once per refill. A client with an empty bucket is
*throttled*: the authenticator answers it 429 without looking its key up, unless the key is
one it already holds as valid (``gateway/auth.py``). A refused attempt is not a failure: it
neither empties the bucket further nor extends the wait. Before each key lookup it starts, the
authenticator records a failure and ``refund``s it unless the attempt fails, so a burst of
concurrent guesses cannot all be looked up before the first of them fails.

The bucket is kept in its GCRA form (the generic cell rate algorithm): one number per client,
the time at which its bucket would be full again; the client is throttled while that time is
more than a window minus one refill ahead.

Bounded: at most ``max_clients`` clients are tracked; past it the one whose last failure is
oldest is forgotten (its bucket has most likely refilled). An attacker with many addresses
gets ``max_failures`` a window from each whatever this bound; IPv6 clients count per /64
network, which one host usually holds whole.

Per gateway process: with ``tandem up --gateway-workers N`` the kernel spreads a client's
connections over the N processes, so a client may fail up to N x ``max_failures`` times in a
burst and N per refill interval.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AuthThrottleConfig:
    """How failed authentications are slowed, per client address."""

    max_failures: int = 10
    """Failed authentications a client may make in a burst before it is throttled (0: never
    throttled)."""
    window_s: float = 60.0
    """The time over which ``max_failures`` refill: a throttled client gets one more attempt
    every ``window_s / max_failures``."""
    max_clients: int = 65_536
    """Clients tracked at once (the memory bound: ~170 bytes each, measured, so ~11 MB full);
    past it the client whose last failure is oldest is forgotten."""
    trusted_proxies: tuple[str, ...] = ()
    """Addresses or networks of proxies whose ``X-Forwarded-For`` names the client
    (``gateway/client_address.py``); empty: the peer is the client."""

    def __post_init__(self) -> None:
        if self.max_failures < 0 or self.window_s <= 0 or self.max_clients < 1:
            raise ValueError(
                "AuthThrottleConfig needs max_failures >= 0, window_s > 0 and max_clients >= 1"
            )


class FailedAuthThrottle:
    """Failed authentications per client; ``clock`` is monotonic seconds (tests pass a fake)."""

    def __init__(
        self, config: AuthThrottleConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._config = config
        self._clock = clock
        self._refill_s = config.window_s / max(config.max_failures, 1)
        # Client -> when its bucket is full again; ordered by last failure, oldest first.
        self._full_at: OrderedDict[str, float] = OrderedDict()

    @property
    def num_clients(self) -> int:
        """Clients tracked now."""
        return len(self._full_at)

    def retry_after_s(self, client: str | None) -> float | None:
        """How long ``client`` must wait before its next attempt is looked at; None if it may
        try now. A client without an address (a unix socket) is never throttled."""
        if client is None or not self._full_at:  # the common case: nobody failed lately
            return None
        full_at = self._full_at.get(client_key(client))
        if full_at is None:
            return None
        wait_s = full_at - self._clock() - (self._config.window_s - self._refill_s)
        return wait_s if wait_s > 0 else None

    def record_failure(self, client: str | None) -> float | None:
        """Count one failed authentication of ``client``; the wait it now faces if this
        failure is the one that throttled it (for one log line per episode), else None."""
        if client is None or self._config.max_failures == 0:
            return None
        was_throttled = self.retry_after_s(client) is not None
        self._add_failure(client)
        return None if was_throttled else self.retry_after_s(client)

    def _add_failure(self, client: str) -> None:
        key = client_key(client)
        now = self._clock()
        full_at = max(self._full_at.pop(key, now), now) + self._refill_s
        self._full_at[key] = full_at  # moved to the end: the newest failure
        while len(self._full_at) > self._config.max_clients:
            self._full_at.popitem(last=False)

    def refund(self, client: str | None) -> None:
        """Give back one failure recorded for ``client`` (a reservation whose attempt did not
        fail); nothing if its state was forgotten meanwhile."""
        if client is None:
            return
        key = client_key(client)
        full_at = self._full_at.get(key)
        if full_at is None:
            return
        full_at -= self._refill_s
        if full_at <= self._clock():
            del self._full_at[key]
        else:
            self._full_at[key] = full_at


@functools.lru_cache(maxsize=4096)  # bounded; spares a parse per request from busy clients
def client_key(address: str) -> str:
    """What a client is counted by: its IPv4 address, its IPv6 /64 network (an IPv4-mapped
    IPv6 address counts as the IPv4 one), or the string itself when it is not an address."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)
