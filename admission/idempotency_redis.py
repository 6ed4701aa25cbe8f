"""The shared idempotency store: the semantics of ``admission.idempotency`` as Lua scripts.

One script per operation, so each is one atomic round trip, and every expiry is a Redis TTL
(``PEXPIRE``): leases and retention run on the server's clock, replicas with skewed clocks
agree, and Redis itself drops what has expired.

One hash per scope, ``<prefix><scope>``:

- running:   ``fp`` (fingerprint), ``tok`` (the owner's token); TTL = the lease
- completed: ``fp``, ``code``, ``body``, ``at``; TTL = the retention

The body travels as base64 because the shared connection (``admission.redis_conn``) decodes
replies as UTF-8 and a stored body must come back byte for byte. ``at`` is ``repr(float)``,
which round-trips exactly.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from admission.idempotency import (
    Claimed,
    ClaimResult,
    InProgress,
    Mismatch,
    Replay,
    StoredResponse,
    check_seconds,
    new_token,
    retry_after_s,
)
from admission.quota import StoreUnavailable
from admission.redis_conn import bounded, connect
from core.errors import StoreUnavailableError

_T = TypeVar("_T")

# ARGV: fingerprint, token, lease ms. Reply: {'claimed'} | {'mismatch'} |
# {'running', lease ms left} | {'done', code, body, at}.
_CLAIM = """
local v = redis.call('HMGET', KEYS[1], 'fp', 'tok', 'code', 'body', 'at')
if not v[1] then
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'tok', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'claimed'}
end
if v[1] ~= ARGV[1] then return {'mismatch'} end
if v[2] then return {'running', redis.call('PTTL', KEYS[1])} end
return {'done', v[3], v[4], v[5]}
"""

# ARGV: token, code, body (base64), at, retention ms. Reply: 1 stored, 0 claim lost.
# A completed record has no 'tok', so a second complete with the same token is refused too.
_COMPLETE = """
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'tok')
redis.call('HSET', KEYS[1], 'code', ARGV[2], 'body', ARGV[3], 'at', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# ARGV: token. Reply: 1 freed, 0 not the owner.
_RELEASE = """
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""

# ARGV: token, lease ms. Reply: 1 renewed, 0 claim lost.
_EXTEND = """
if redis.call('HGET', KEYS[1], 'tok') ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisIdempotencyStore:
    """``IdempotencyStore`` in Redis, shared by every gateway replica pointed at the same
    server."""

    def __init__(self, url: str, *, timeout_s: float = 2.0, prefix: str = "tandem:idem:") -> None:
        self._redis = connect(url, timeout_s)  # see admission/redis_conn.py
        self._prefix = prefix
        self._where = _redacted(url)
        # Bounds a whole call (connect, EVALSHA, the script-cache fallback after a restart),
        # where the socket timeouts bound each operation alone.
        self._deadline_s = 2 * timeout_s
        self._claim = self._redis.register_script(_CLAIM)
        self._complete = self._redis.register_script(_COMPLETE)
        self._release = self._redis.register_script(_RELEASE)
        self._extend = self._redis.register_script(_EXTEND)

    async def claim(self, scope: str, fingerprint: str, lease_s: float) -> ClaimResult:
        """Atomically take a free ``scope`` for ``lease_s`` seconds (``Claimed``), or say why
        not: ``InProgress``, ``Mismatch`` or ``Replay``."""
        check_seconds("lease_s", lease_s)
        token = new_token()
        reply: list[Any] = await self._run(
            self._claim([self._key(scope)], [fingerprint, token, _ms(lease_s)])
        )
        match reply[0]:
            case "claimed":
                return Claimed(token)
            case "mismatch":
                return Mismatch()
            case "running":
                return InProgress(retry_after_s(int(reply[1]) / 1000))
            case "done":
                return Replay(
                    StoredResponse(
                        status_code=int(reply[1]),
                        body=base64.b64decode(reply[2]),
                        created_at=float(reply[3]),
                    )
                )
        raise RuntimeError(f"idempotency claim script answered {reply!r}")  # a bug, not an outage

    async def complete(
        self, scope: str, token: str, response: StoredResponse, retention_s: float
    ) -> bool:
        """Store ``response`` for ``retention_s`` seconds if ``token`` still owns the running
        claim; ``False`` (and nothing changed) if the claim was lost or already completed."""
        check_seconds("retention_s", retention_s)
        args = [
            token,
            str(response.status_code),
            base64.b64encode(response.body).decode("ascii"),
            repr(float(response.created_at)),
            _ms(retention_s),
        ]
        return int(await self._run(self._complete([self._key(scope)], args))) == 1

    async def release(self, scope: str, token: str) -> None:
        """Free ``scope`` if ``token`` still owns its running claim; otherwise do nothing (a
        completed response or another request's claim stays)."""
        await self._run(self._release([self._key(scope)], [token]))

    async def extend(self, scope: str, token: str, lease_s: float) -> bool:
        """Renew the running claim's lease to ``lease_s`` seconds from now; ``False`` if
        ``token`` lost it."""
        check_seconds("lease_s", lease_s)
        reply = await self._run(self._extend([self._key(scope)], [token, _ms(lease_s)]))
        return int(reply) == 1

    async def aclose(self) -> None:
        """Release connections."""
        await self._redis.aclose()

    def _key(self, scope: str) -> str:
        return f"{self._prefix}{scope}"

    async def _run(self, call: Awaitable[_T]) -> _T:
        try:
            return await bounded(call, self._deadline_s, "idempotency store")
        except StoreUnavailable as exc:
            raise StoreUnavailableError(
                f"The idempotency store (Redis at {self._where}) is unavailable ({exc}); check "
                "that the server is up and reachable from the gateway at that address."
            ) from (exc.__cause__ or exc)


def _ms(seconds: float) -> str:
    """Whole milliseconds for ``PEXPIRE``, at least 1 (a sub-millisecond TTL must not be 0)."""
    return str(max(1, math.ceil(seconds * 1000)))


def _redacted(url: str) -> str:
    """``url`` without its credentials, fit for an error message."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path}"
