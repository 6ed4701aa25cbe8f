"""Idempotency keys: parse the header, fingerprint the body, and store claims and results.

Semantics (docs/WIRE.md §3; the in-memory store here and the Redis store's Lua scripts implement
exactly these):

- A key is scoped by tenant, route and the client's key (``scope_key``); the body's
  ``fingerprint`` ignores ``stream`` and ``stream_options``, so a dropped stream may be retried
  as non-streaming and vice versa.
- ``claim`` is one atomic step. A free scope (nothing stored, or its record expired) becomes a
  running claim owned by a fresh random token, for ``lease_s``: a gateway that dies mid-request
  frees the key when the lease runs out. Otherwise the caller learns ``InProgress`` (same
  fingerprint, still running), ``Mismatch`` (another fingerprint, running or completed) or
  ``Replay`` (same fingerprint, completed: the stored response).
- Only the token's owner may ``complete`` (store the response for ``retention_s``),
  ``release`` (free the key: rejected before execution, or aborted) or ``extend`` (renew the
  lease of a long stream). A token whose lease expired has lost the key, even if nobody took it
  since: ``complete`` and ``extend`` then return ``False`` and change nothing.
- Each store keeps its own clock for leases and retention (Redis: its TTLs), so replicas with
  skewed clocks agree. ``StoredResponse.created_at`` is wall-clock time set by the caller.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from secrets import token_hex
from typing import Any, Protocol, TypeAlias

import orjson

from core.errors import InvalidRequestError

__all__ = [
    "MAX_KEY_LENGTH",
    "RETRY_AFTER_MAX_S",
    "RETRY_AFTER_MIN_S",
    "ClaimResult",
    "Claimed",
    "IdempotencyStore",
    "InProgress",
    "MemoryIdempotencyStore",
    "Mismatch",
    "Replay",
    "StoredResponse",
    "check_seconds",
    "fingerprint",
    "new_token",
    "parse_idempotency_key",
    "retry_after_s",
    "scope_key",
]

HEADER = "Idempotency-Key"
MAX_KEY_LENGTH = 255
"""Longest key accepted, in characters after unquoting (Stripe's limit)."""
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 10.0
"""``InProgress.retry_after_s`` is the lease left, clamped to this range: a lease is sized for the
longest request and renewed while it streams, so most requests end long before it runs out and
a client told the whole lease would wait far too long; 1 s keeps retries from hammering."""

_STREAM_FIELDS = frozenset({"stream", "stream_options"})
_KEY_RULE = (
    f"1 to {MAX_KEY_LENGTH} printable ASCII characters (space through '~'), either bare or as a "
    'quoted string ("..." where \\" and \\\\ are the only escapes)'
)


# --- Header, fingerprint and scope -----------------------------------------------------------


def parse_idempotency_key(header: str | None) -> str | None:
    """The key of an ``Idempotency-Key`` header value, ``None`` when absent.

    Bare values are taken as they are; values starting with ``"`` must be an RFC 8941 sf-string.
    Surrounding whitespace is ignored (HTTP's optional whitespace). Raises
    ``InvalidRequestError`` (``param="Idempotency-Key"``) for anything else.
    """
    if header is None:
        return None
    value = header.strip(" \t")
    key = _unquote(value) if value.startswith('"') else value
    if not key:
        raise _invalid_key("is empty")
    if len(key) > MAX_KEY_LENGTH:
        raise _invalid_key(f"is {len(key)} characters long")
    if not all(" " <= char <= "~" for char in key):
        raise _invalid_key("contains a character that is not printable ASCII")
    return key


def _unquote(value: str) -> str:
    """The content of an sf-string; ``value`` starts with ``"``."""
    chars: list[str] = []
    i = 1
    while i < len(value):
        char = value[i]
        if char == "\\":
            if i + 1 >= len(value) or value[i + 1] not in '"\\':
                raise _invalid_key("has a backslash that does not escape '\"' or '\\'")
            chars.append(value[i + 1])
            i += 2
        elif char == '"':
            if i != len(value) - 1:
                raise _invalid_key("has characters after its closing quote")
            return "".join(chars)
        else:
            chars.append(char)
            i += 1
    raise _invalid_key("has no closing quote")


def _invalid_key(problem: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"The {HEADER} header {problem}; send {_KEY_RULE}.",
        param=HEADER,
    )


def fingerprint(body: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of the body's canonical JSON without top-level ``stream`` and
    ``stream_options``: sorted keys at every level, no whitespace, UTF-8. The client's key order
    and whitespace do not matter; any value does."""
    trimmed = {name: value for name, value in body.items() if name not in _STREAM_FIELDS}
    try:
        canonical = orjson.dumps(trimmed, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:
        # orjson refuses integers past 64 bits, which a body parsed elsewhere may hold. The
        # fallback is deterministic in the value too, so one body always takes the same path.
        canonical = json.dumps(
            trimmed, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
    return hashlib.sha256(canonical).hexdigest()


def scope_key(tenant_id: str, route: str, key: str) -> str:
    """The store key of a client's key: ``<len>:<tenant>:<len>:<route>:<key>``. The length
    prefixes keep it unambiguous whatever the parts contain (``a:b`` + ``c`` is not
    ``a`` + ``b:c``), and it stays readable for whoever inspects the store."""
    return f"{len(tenant_id)}:{tenant_id}:{len(route)}:{route}:{key}"


# --- What a store holds and answers ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A completed request's result as the client got it: the final JSON body of a completion
    or of an error."""

    status_code: int
    body: bytes
    created_at: float
    """Wall-clock (``time.time()``) seconds when the response was produced."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """The caller owns the key and must later ``complete`` or ``release`` it with ``token``."""

    token: str


@dataclass(frozen=True, slots=True)
class InProgress:
    """Another request with this key and the same fingerprint is running."""

    retry_after_s: float
    """Lease left, clamped to [``RETRY_AFTER_MIN_S``, ``RETRY_AFTER_MAX_S``]."""


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key was used with another fingerprint (running or completed)."""


@dataclass(frozen=True, slots=True)
class Replay:
    """Completed with the same fingerprint: send this again."""

    response: StoredResponse


ClaimResult: TypeAlias = Claimed | InProgress | Mismatch | Replay


class IdempotencyStore(Protocol):
    """Where claims and results live: in memory (one gateway) or in Redis (shared by replicas).

    Every method raises ``core.errors.StoreUnavailableError`` when the store cannot be reached,
    and ``ValueError`` for a non-positive duration (a caller's bug).
    """

    async def claim(self, scope: str, fingerprint: str, lease_s: float) -> ClaimResult:
        """Atomically take a free ``scope`` for ``lease_s`` seconds (``Claimed``), or say why
        not: ``InProgress``, ``Mismatch`` or ``Replay``."""
        ...

    async def complete(
        self, scope: str, token: str, response: StoredResponse, retention_s: float
    ) -> bool:
        """Store ``response`` for ``retention_s`` seconds if ``token`` still owns the running
        claim; ``False`` (and nothing changed) if the claim was lost or already completed."""
        ...

    async def release(self, scope: str, token: str) -> None:
        """Free ``scope`` if ``token`` still owns its running claim; otherwise do nothing (a
        completed response or another request's claim stays)."""
        ...

    async def extend(self, scope: str, token: str, lease_s: float) -> bool:
        """Renew the running claim's lease to ``lease_s`` seconds from now; ``False`` if
        ``token`` lost it."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def check_seconds(name: str, seconds: float) -> None:
    """The durations every store refuses (a caller's bug, not a client error)."""
    if not seconds > 0:  # also refuses NaN
        raise ValueError(f"{name} must be > 0 seconds, got {seconds}")


def retry_after_s(lease_left_s: float) -> float:
    """``InProgress.retry_after_s`` for a lease with ``lease_left_s`` to run."""
    return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, lease_left_s))


def new_token() -> str:
    """A claim's owner token: 128 random bits, so no other request can guess it."""
    return token_hex(16)


# --- The in-process store --------------------------------------------------------------------


@dataclass(slots=True)
class _Record:
    fingerprint: str
    expires_at: float
    """On the store's clock; the record is gone from this moment."""
    token: str | None
    """The running claim's owner; ``None`` once completed."""
    response: StoredResponse | None = None


class MemoryIdempotencyStore:
    """``IdempotencyStore`` in this process (the embedded default, one gateway).

    Safe under asyncio because no method awaits between reading and writing a record. Memory is
    bounded: expired records are swept on every ``claim`` and ``complete`` (a heap of expiries),
    and past ``max_entries`` records a new claim evicts the oldest completed record first (a
    replay lost early), or, when every record is a running claim, the oldest claim (its owner's
    ``complete`` and ``extend`` then return ``False``).
    """

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, max_entries: int = 100_000
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self._clock = clock
        self._max_entries = max_entries
        # Insertion order = claim order, so the first running record is the oldest claim.
        self._records: dict[str, _Record] = {}
        self._completed: OrderedDict[str, None] = OrderedDict()
        """Scopes of completed records, oldest completion first."""
        # (expiry, scope), one entry per expiry ever set: entries outdated by extend, complete
        # or release stay until due and are then skipped; _sweep compacts when they pile up.
        self._expiries: list[tuple[float, str]] = []

    @property
    def num_records(self) -> int:
        """Records held, running or completed (expired ones until the next sweep)."""
        return len(self._records)

    async def claim(self, scope: str, fingerprint: str, lease_s: float) -> ClaimResult:
        """Atomically take a free ``scope`` for ``lease_s`` seconds (``Claimed``), or say why
        not: ``InProgress``, ``Mismatch`` or ``Replay``."""
        check_seconds("lease_s", lease_s)
        now = self._clock()
        self._sweep(now)
        record = self._records.get(scope)
        if record is not None:
            if record.fingerprint != fingerprint:
                return Mismatch()
            if record.response is not None:
                return Replay(record.response)
            return InProgress(retry_after_s(record.expires_at - now))
        while len(self._records) >= self._max_entries:
            self._evict_one()
        token = new_token()
        self._records[scope] = _Record(fingerprint, now + lease_s, token)
        heapq.heappush(self._expiries, (now + lease_s, scope))
        return Claimed(token)

    async def complete(
        self, scope: str, token: str, response: StoredResponse, retention_s: float
    ) -> bool:
        """Store ``response`` for ``retention_s`` seconds if ``token`` still owns the running
        claim; ``False`` (and nothing changed) if the claim was lost or already completed."""
        check_seconds("retention_s", retention_s)
        now = self._clock()
        self._sweep(now)
        record = self._owned(scope, token, now)
        if record is None:
            return False
        record.token = None
        record.response = response
        record.expires_at = now + retention_s
        heapq.heappush(self._expiries, (record.expires_at, scope))
        self._completed[scope] = None
        return True

    async def release(self, scope: str, token: str) -> None:
        """Free ``scope`` if ``token`` still owns its running claim; otherwise do nothing (a
        completed response or another request's claim stays)."""
        if self._owned(scope, token, self._clock()) is not None:
            del self._records[scope]

    async def extend(self, scope: str, token: str, lease_s: float) -> bool:
        """Renew the running claim's lease to ``lease_s`` seconds from now; ``False`` if
        ``token`` lost it."""
        check_seconds("lease_s", lease_s)
        now = self._clock()
        record = self._owned(scope, token, now)
        if record is None:
            return False
        record.expires_at = now + lease_s
        heapq.heappush(self._expiries, (record.expires_at, scope))
        return True

    async def aclose(self) -> None:
        """Nothing to release."""

    def _owned(self, scope: str, token: str, now: float) -> _Record | None:
        """The running record ``token`` owns, unless its lease ran out (not yet swept)."""
        record = self._records.get(scope)
        if record is None or record.token != token or record.expires_at <= now:
            return None
        return record

    def _sweep(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, scope = heapq.heappop(self._expiries)
            record = self._records.get(scope)
            # The entry may be outdated (the record was extended, completed or replaced):
            # the record's own expiry decides.
            if record is not None and record.expires_at <= now:
                self._drop(scope)
        if len(self._expiries) > 2 * len(self._records) + 1024:
            self._expiries = [(r.expires_at, scope) for scope, r in self._records.items()]
            heapq.heapify(self._expiries)

    def _evict_one(self) -> None:
        # When every record is running, the first in claim order is the oldest claim.
        self._drop(next(iter(self._completed or self._records)))

    def _drop(self, scope: str) -> None:
        del self._records[scope]
        self._completed.pop(scope, None)
