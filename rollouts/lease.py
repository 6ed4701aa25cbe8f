"""Who evaluates rollouts: one gateway at a time holds a lease, with a fencing token.

A holder acquires the lease for ``ttl_s`` and renews it (acquires again) well before that runs
out; a gateway that stops renewing (crashed, partitioned, paused) loses it when it expires, and
another takes it. The token grows on every new acquisition (another holder, or the same holder
after expiry) and stays the same while one holder renews: the rollout store refuses saves with
a token older than the newest it has seen (``rollouts.store.FencedOutError``), so a holder that
lost the lease without noticing cannot overwrite its successor's work.

- ``RedisLease``: replicas sharing a Redis server. Keys (``<p>`` is ``key_prefix``, ``<n>`` the
  lease's ``name``): ``<p><n>`` string, the holder, expiring by ``PX`` (the server's clock: the
  gateways' clocks do not matter); ``<p><n>:token`` string, the token counter (``INCR``), whose
  value is the current holder's token. Acquire and release are one Lua script each; both keys
  are passed in ``KEYS``, so on Redis Cluster the prefix must carry a hash tag.
- ``SqliteLease``: the embedded default, processes of one host sharing a file. A table
  ``lease`` (name, holder, expires_at, token) in a SQLite file that belongs to the lease alone
  (e.g. ``<state_dir>/lease.db``): another ``SqliteFile`` with its own migrations on the same
  file (the rollout store's) would fight over ``PRAGMA user_version``. Expiry is by the
  ``clock`` passed in, wall-clock time by default, which every process of the host shares
  (``time.monotonic`` is per boot and not comparable across machines sharing a file system).

Every method may raise ``StoreUnavailable`` (``admission.quota``) when the store cannot be
reached; a holder that cannot renew must assume it lost the lease when its ttl runs out.
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, TypeVar

from admission.quota import StoreUnavailable
from admission.redis_conn import bounded, connect
from core.sqlite import SqliteFile, transaction

_T = TypeVar("_T")


class Lease(Protocol):
    """Who evaluates rollouts: one holder at a time, with a fencing token."""

    async def acquire(self, holder: str, ttl_s: float) -> int | None:
        """If nobody holds the lease, or it expired, or ``holder`` holds it: ``holder`` holds
        it for ``ttl_s`` from now; its fencing token, incremented on every new acquisition and
        unchanged while the same holder renews. None while another holder holds it."""
        ...

    async def release(self, holder: str) -> None:
        """If ``holder`` holds the lease, drop it now (another may acquire it at once); else
        nothing."""
        ...

    async def holder(self) -> tuple[str, int] | None:
        """The current holder and its token, if the lease is held and unexpired."""
        ...

    async def aclose(self) -> None:
        """Release the file or connections (not the lease: it expires by itself)."""
        ...


# KEYS: holder, token counter. ARGV: holder, ttl in milliseconds.
# Reply: the token, or nil (another holder's unexpired lease).
_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  local token = redis.call('GET', KEYS[2])
  if token then return tonumber(token) end
  return redis.call('INCR', KEYS[2])
end
if current then return false end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS: holder. ARGV: holder. Reply: 1 if it was dropped, else 0.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisLease:
    """The lease in Redis; see the module docstring for the keys. Construction does no I/O."""

    def __init__(
        self,
        url: str,
        *,
        name: str = "rollouts",
        timeout_s: float = 2.0,
        key_prefix: str = "tandem:lease:",
    ) -> None:
        self._redis = connect(url, timeout_s)  # see admission/redis_conn.py
        self._holder_key = f"{key_prefix}{name}"
        self._token_key = f"{key_prefix}{name}:token"
        self._deadline_s = 2 * timeout_s
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._release = self._redis.register_script(_RELEASE)

    async def start(self) -> None:
        """Reach the server now (one ``PING``); ``StoreUnavailable`` if it does not answer."""
        await self._run(self._redis.ping())

    async def acquire(self, holder: str, ttl_s: float) -> int | None:
        """Acquire or renew for ``ttl_s``; the token, or None (see ``Lease.acquire``). One
        round trip."""
        _check(holder, ttl_s)
        # Whole milliseconds, rounded up: a ttl never shrinks to 0 (PX refuses 0).
        args = [holder, str(max(1, math.ceil(ttl_s * 1000)))]
        token = await self._run(self._acquire([self._holder_key, self._token_key], args))
        return None if token is None else int(token)

    async def release(self, holder: str) -> None:
        """Drop the lease if ``holder`` holds it. One round trip."""
        await self._run(self._release([self._holder_key], [holder]))

    async def holder(self) -> tuple[str, int] | None:
        """The current holder and its token, if held. One ``MGET``: both read at one instant."""
        current, token = await self._run(self._redis.mget([self._holder_key, self._token_key]))
        if current is None or token is None:
            return None
        return str(current), int(token)

    async def aclose(self) -> None:
        """Release the connections."""
        await self._redis.aclose()

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await bounded(call, self._deadline_s, "rollout lease")


_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        # A released or expired lease keeps its row: the next token counts on from it.
        """CREATE TABLE lease (
            name       TEXT PRIMARY KEY,
            holder     TEXT,
            expires_at REAL NOT NULL,
            token      INTEGER NOT NULL
        )""",
    ),
)
SCHEMA_VERSION = len(_MIGRATIONS)
"""The ``user_version`` ``SqliteLease`` writes and reads in its file."""


class SqliteLease:
    """The lease in a SQLite file of its own; see the module docstring. Construction does no
    I/O; the file opens on first use (or ``start()``)."""

    def __init__(
        self, path: Path, *, name: str = "rollouts", clock: Callable[[], float] = time.time
    ) -> None:
        self._file = SqliteFile(
            path, what="rollout lease", migrations=_MIGRATIONS, unavailable=StoreUnavailable
        )
        self._name = name
        self._clock = clock

    async def start(self) -> None:
        """Open the file now (folders, WAL, schema); ``StoreUnavailable`` if it cannot be."""
        await self._file.start()

    async def acquire(self, holder: str, ttl_s: float) -> int | None:
        """Acquire or renew for ``ttl_s``; the token, or None (see ``Lease.acquire``)."""
        _check(holder, ttl_s)

        def take(conn: sqlite3.Connection) -> int | None:
            with transaction(conn):
                # Read the clock inside the write lock: a call that waited for another
                # process's write must not judge expiry by the time before it waited.
                now = self._clock()
                row = conn.execute(
                    "SELECT holder, expires_at, token FROM lease WHERE name = ?", (self._name,)
                ).fetchone()
                if row is not None and row[0] is not None and row[1] > now:
                    if row[0] != holder:
                        return None
                    token = int(row[2])  # a renewal keeps the token
                else:
                    token = 1 if row is None else int(row[2]) + 1
                conn.execute(
                    "INSERT INTO lease (name, holder, expires_at, token) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (name) DO UPDATE SET holder = excluded.holder,"
                    " expires_at = excluded.expires_at, token = excluded.token",
                    (self._name, holder, now + ttl_s, token),
                )
                return token

        return await self._file.run(take)

    async def release(self, holder: str) -> None:
        """Drop the lease if ``holder`` holds it (expired or not: nobody else does then)."""

        def drop(conn: sqlite3.Connection) -> None:
            with transaction(conn):
                conn.execute(
                    "UPDATE lease SET holder = NULL WHERE name = ? AND holder = ?",
                    (self._name, holder),
                )

        await self._file.run(drop)

    async def holder(self) -> tuple[str, int] | None:
        """The current holder and its token, if held and unexpired."""

        def select(conn: sqlite3.Connection) -> tuple[str, int] | None:
            row = conn.execute(
                "SELECT holder, token FROM lease WHERE name = ? AND holder IS NOT NULL"
                " AND expires_at > ?",
                (self._name, self._clock()),
            ).fetchone()
            return None if row is None else (str(row[0]), int(row[1]))

        return await self._file.run(select)

    async def aclose(self) -> None:
        """Close the file; later calls raise ``StoreUnavailable``. Idempotent."""
        await self._file.aclose()


def _check(holder: str, ttl_s: float) -> None:
    """``ValueError`` for a holder or ttl no lease can take."""
    if not isinstance(holder, str) or not holder:
        raise ValueError(f"lease holder: a non-empty name, not {holder!r}")
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        raise ValueError(f"lease ttl_s: seconds, more than 0, not {ttl_s!r}")
