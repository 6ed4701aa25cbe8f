"""Who is calling: tenant keys on the OpenAI routes, the admin credential on ``/admin``.

Key lookups are cached: an answer is served while it is younger than ``cache_ttl_s`` plus
``refresh_ahead_s`` (0.5 + 0.4 s); past that a request waits for its own lookup. Every
``cache_ttl_s`` one background task looks up again the keys served since its last round, so a
key used again within 0.9 s of its last use never waits for the store (a lookup is a hop to a
store thread or Redis: about a millisecond at low load). The refresh runs on its own clock, not
in a request's path: started by the request that found its key stale, the lookup's work fell
inside that request's wait for its first token (0.1 to 0.2 ms of added TTFT at one stream,
``docs/ARCHITECTURE.md``, "The hot path"). A revoked key or a changed plan takes
effect on every replica within 0.9 s (at once on the one that made the change), while the store
sees at most two lookups per key in use per second. Last-used times are collected in memory and
written in batches.

Failed authentications are counted per client address (``gateway/auth_throttle.py``): a client
past its allowance gets 429 ``too_many_auth_failures`` without its key being looked up, unless
the key is one this gateway holds in its cache as valid (a legitimate client behind the same
address as a guesser keeps working with the key it uses). A failure is a missing, unknown or
revoked tenant key, or a missing or wrong admin key on ``/admin``; the right admin key is
never throttled (checking it looks nothing up).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from admission.plans import Plan
from admission.quota import StoreUnavailable
from admission.registry import TenantRegistry
from admission.tenants import ApiKey, Tenant, hash_key
from core.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RateLimitError,
    StoreUnavailableError,
)
from gateway.auth_throttle import AuthThrottleConfig, FailedAuthThrottle
from gateway.client_address import current_client, is_local

log = logging.getLogger("tandem.auth")

T = TypeVar("T")

ANONYMOUS = Tenant(
    tenant_id="anonymous", name="anonymous", plan=Plan(), created_at=0.0, updated_at=0.0
)
"""The tenant of every request when authentication is switched off (local development)."""

_MAX_CACHED_KEYS = 100_000
# While the store is down, a key seen recently keeps working for this long.
_STALE_GRACE_S = 300.0
# Lookups a refresh round has under way at once: a round of many keys does not queue them all
# at the store ahead of a request waiting for a key it has not seen.
_REFRESH_CONCURRENCY = 8


@dataclass(frozen=True, slots=True)
class Caller:
    """An authenticated client."""

    tenant: Tenant
    key: ApiKey | None
    """``None`` for the anonymous tenant."""


@dataclass(slots=True)
class _Cached:
    found: tuple[ApiKey, Tenant] | None
    fetched_at: float


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    """Resolves API keys to tenants; ``start()``/``aclose()`` own the last-used writer."""

    def __init__(
        self,
        registry: TenantRegistry,
        *,
        required: bool = True,
        cache_ttl_s: float = 0.5,
        refresh_ahead_s: float = 0.4,
        touch_interval_s: float = 5.0,
        throttle: AuthThrottleConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._throttle_config = throttle or AuthThrottleConfig()
        self._throttle = FailedAuthThrottle(self._throttle_config, clock)
        self._required = required
        self._cache_ttl_s = cache_ttl_s
        self._refresh_ahead_s = refresh_ahead_s
        self._touch_interval_s = touch_interval_s
        self._clock = clock
        self._cache: dict[str, _Cached] = {}
        self._last_used: dict[str, float] = {}
        self._fetching: dict[str, asyncio.Future[tuple[ApiKey, Tenant] | None]] = {}
        self._in_use: set[str] = set()
        """Digests looked up since the last refresh round: the next round refreshes them."""
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._touch_loop(), name="tandem-key-last-used"),
            asyncio.create_task(self._refresh_loop(), name="tandem-key-cache-refresh"),
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._flush_last_used()

    async def authenticate(self, authorization: str | None) -> Caller:
        """The caller behind an ``Authorization`` header, or 401."""
        token = bearer_token(authorization)
        if not self._required:
            found = await self._lookup(hash_key(token)) if token else None
            if found is None or found[0].is_revoked:
                return Caller(ANONYMOUS, None)
            return self._accept(*found)
        return await self.guarded(token, lambda digest: self._tenant_caller(token, digest))

    async def _tenant_caller(self, token: str | None, digest: str | None) -> Caller:
        if token is None or digest is None:
            raise AuthenticationError(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' "
                "(the OpenAI SDKs do this with api_key=...).",
                code="missing_api_key",
            )
        found = await self._lookup(digest)
        if found is None:
            raise AuthenticationError(
                f"Incorrect API key provided: {_redact(token)}. Ask your Tandem admin for a key.",
            )
        if found[0].is_revoked:
            raise AuthenticationError(
                f"The API key {found[0].display_prefix}... was revoked. Use another key.",
                code="revoked_api_key",
            )
        return self._accept(*found)

    async def guarded(self, token: str | None, attempt: Callable[[str | None], Awaitable[T]]) -> T:
        """``attempt`` (which authenticates ``token``, given its ``hash_key`` digest, hashed
        once a request; raising ``AuthenticationError`` when that fails) under this request's
        client's failed-authentication allowance: 429 while the client is throttled, unless
        ``token`` is a key this gateway holds as valid.

        An attempt that will start a key lookup reserves a failure before it, given back
        unless the attempt fails: otherwise a burst of concurrent guesses would all be looked
        up before the first failure counted. Attempts that look nothing up (a cached answer,
        a lookup of the same key already under way, no key) count when they fail."""
        client = current_client()
        digest = None if token is None else hash_key(token)
        if digest is None or not self._holds_valid(digest):
            wait_s = self._throttle.retry_after_s(client)
            if wait_s is not None:
                raise self._throttled(wait_s)
        reserved = digest is not None and self._starts_lookup(digest)
        throttled_by = self._throttle.record_failure(client) if reserved else None
        try:
            result = await attempt(digest)
        except AuthenticationError:
            if not reserved:
                throttled_by = self._throttle.record_failure(client)
            if throttled_by is not None:
                log.warning(
                    "client %s throttled after %d failed authentications: its unverified keys "
                    "are refused for %.1f s (TANDEM_AUTH_FAILURE_LIMIT)",
                    client, self._throttle_config.max_failures, throttled_by,
                )  # fmt: skip
            raise
        except BaseException:
            if reserved:
                self._throttle.refund(client)
            raise
        if reserved:
            self._throttle.refund(client)
        return result

    def _throttled(self, wait_s: float) -> RateLimitError:
        config = self._throttle_config
        return RateLimitError(
            f"Too many failed authentications from your address ({config.max_failures} "
            f"within {config.window_s:g} s). Retry in {math.ceil(wait_s)} s with a valid key; "
            "until then only keys this gateway has already verified are accepted from it.",
            code="too_many_auth_failures",
            retry_after_s=wait_s,
        )

    def _holds_valid(self, digest: str) -> bool:
        cached = self._cache.get(digest)
        return cached is not None and cached.found is not None and not cached.found[0].is_revoked

    def _starts_lookup(self, digest: str) -> bool:
        """Whether ``_lookup`` of ``digest`` now waits for a fetch this request starts."""
        cached = self._cache.get(digest)
        if cached is not None and self._servable(cached):
            return False
        return digest not in self._fetching

    def _servable(self, cached: _Cached) -> bool:
        """Whether a cached answer is young enough to serve (TTL plus refresh-ahead)."""
        return self._clock() - cached.fetched_at < self._cache_ttl_s + self._refresh_ahead_s

    async def is_tenant_key(self, token: str) -> bool:
        """Whether ``token`` is a tenant's key (to tell 403 from 401 on the admin API)."""
        return await self._lookup(hash_key(token)) is not None

    def _accept(self, key: ApiKey, tenant: Tenant) -> Caller:
        self._last_used[key.key_id] = time.time()
        return Caller(tenant, key)

    async def _lookup(self, digest: str) -> tuple[ApiKey, Tenant] | None:
        """The key whose ``hash_key`` digest this is, and its tenant; None for no such key."""
        self._in_use.add(digest)
        cached = self._cache.get(digest)
        if cached is not None and self._servable(cached):
            return cached.found  # the next refresh round looks it up again
        # Shielded: one waiter's client leaving must not cancel the lookup the others share.
        return await asyncio.shield(self._fetch_once(digest, cached))

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self._cache_ttl_s)
            await self.refresh_in_use()

    async def refresh_in_use(self) -> None:
        """One refresh round: each known key looked up since the last round is looked up
        again, ``_REFRESH_CONCURRENCY`` at a time. A lookup that fails leaves its answer to
        age: a request past its bound then waits for its own lookup, which reports the
        failure."""
        in_use, self._in_use = self._in_use, set()
        # An unknown key's answer ages out instead: a flood of made-up keys is not looked up
        # twice.
        due = [
            digest
            for digest in in_use
            if (cached := self._cache.get(digest)) is not None and cached.found is not None
        ]
        for start in range(0, len(due), _REFRESH_CONCURRENCY):
            batch = due[start : start + _REFRESH_CONCURRENCY]
            await asyncio.gather(
                *(self._fetch_once(digest, self._cache.get(digest)) for digest in batch),
                return_exceptions=True,
            )

    def forget(self, *, key_id: str | None = None, tenant_id: str | None = None) -> None:
        """Drop the cached answers of a key, or of every key of a tenant: this gateway's own
        admin change (a revocation, a new plan) takes effect here at once, other replicas
        within the cache's bound."""
        for digest, cached in list(self._cache.items()):
            if cached.found is None:
                continue
            key, tenant = cached.found
            if key.key_id == key_id or tenant.tenant_id == tenant_id:
                del self._cache[digest]

    def _fetch_once(
        self, digest: str, cached: _Cached | None
    ) -> asyncio.Future[tuple[ApiKey, Tenant] | None]:
        """The lookup of ``digest`` under way, started if none is. One store round trip per
        key at a time: otherwise every request of a burst on a cold (or just expired) entry
        goes to the store at once, and under load those lookups time out and fail requests a
        single lookup would have let through."""
        fetch = self._fetching.get(digest)
        if fetch is None:
            fetch = asyncio.ensure_future(self._fetch(digest, cached))
            self._fetching[digest] = fetch
            fetch.add_done_callback(lambda done: self._fetched(digest, done))
        return fetch

    def _fetched(self, digest: str, fetch: asyncio.Future[tuple[ApiKey, Tenant] | None]) -> None:
        self._fetching.pop(digest, None)
        if not fetch.cancelled():
            fetch.exception()  # retrieved here, so a lookup whose waiters all left is not logged

    async def _fetch(self, digest: str, cached: _Cached | None) -> tuple[ApiKey, Tenant] | None:
        now = self._clock()
        try:
            found = await self._registry.lookup_key(digest)
        except StoreUnavailable as exc:
            if cached is not None and now - cached.fetched_at < _STALE_GRACE_S:
                return cached.found
            raise StoreUnavailableError(
                "API keys cannot be checked right now; retry shortly.", retry_after_s=2.0
            ) from exc
        if len(self._cache) >= _MAX_CACHED_KEYS:
            self._cache.clear()  # crude but bounded: a flood of random keys cannot grow it
        self._cache[digest] = _Cached(found, now)
        return found

    async def _touch_loop(self) -> None:
        while True:
            await asyncio.sleep(self._touch_interval_s)
            await self._flush_last_used()

    async def _flush_last_used(self) -> None:
        if not self._last_used:
            return
        batch, self._last_used = self._last_used, {}
        try:
            await self._registry.touch_keys(batch)
        except StoreUnavailable as exc:
            log.warning("could not record keys' last use (%s); will retry", exc)
            for key_id, when in batch.items():
                self._last_used[key_id] = max(when, self._last_used.get(key_id, 0.0))


class AdminAuth:
    """The admin credential: a tenant key is never accepted on ``/admin``."""

    def __init__(
        self, admin_key: str | None, authenticator: Authenticator, *, metrics_public: bool = False
    ) -> None:
        """``metrics_public``: anyone may read ``/metrics``; else only clients on this host
        and the admin key."""
        self._admin_key = admin_key
        self._authenticator = authenticator
        self._metrics_public = metrics_public

    async def check(self, authorization: str | None) -> str:
        """The admin's id for the audit log (``admin-`` and 8 hex of the key's SHA-256) for
        the admin key; 403 for a tenant key; 429 while the client is throttled (the admin key
        itself passes); 401 otherwise."""
        return await self._check(
            authorization, "The admin API needs 'Authorization: Bearer ADMIN_KEY'."
        )

    async def check_metrics(self, authorization: str | None) -> None:
        """``/metrics`` shows every tenant's tokens, spend and budget: a client on this host
        (the scrapers of one machine) reads it freely, any other needs the admin key, as
        ``check`` answers, unless the metrics are public."""
        if self._metrics_public or is_local(current_client()):
            return
        await self._check(
            authorization,
            "/metrics shows every tenant's usage: from another host it needs "
            "'Authorization: Bearer ADMIN_KEY' (or TANDEM_METRICS_PUBLIC=true where only "
            "scrapers reach this port).",
        )

    async def _check(self, authorization: str | None, needs: str) -> str:
        token = bearer_token(authorization)
        if self._admin_key is None:
            raise AuthenticationError(
                "The admin API is closed: this gateway was started without an admin key "
                "(set TANDEM_ADMIN_KEY).",
                code="admin_api_disabled",
            )
        # Compared as bytes: compare_digest refuses str with non-ASCII characters (TypeError),
        # and header bytes past ASCII arrive as such (latin-1).
        if token is not None and secrets.compare_digest(token.encode(), self._admin_key.encode()):
            return "admin-" + hashlib.sha256(token.encode()).hexdigest()[:8]

        async def refuse(_: str | None) -> str:
            if token is not None and await self._authenticator.is_tenant_key(token):
                raise PermissionDeniedError(
                    "Tenant API keys cannot use the admin API; use the admin key "
                    "(TANDEM_ADMIN_KEY, or the file named in the gateway's startup log)."
                )
            raise AuthenticationError(needs, code="invalid_admin_key")

        return await self._authenticator.guarded(token, refuse)


def _redact(token: str) -> str:
    return f"{token[:6]}...{token[-4:]}" if len(token) > 12 else "***"
