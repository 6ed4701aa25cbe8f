"""The shared quota store: the semantics of ``admission.quota`` as Lua scripts in Redis.

One script per operation, so reserve and reconcile are each one atomic round trip, and the
clock is Redis ``TIME``: replicas with skewed clocks see the same buckets.

Keys of one tenant (the ``{tenant}`` hash tag puts all three in one Redis Cluster slot, which a
multi-key script needs):

- ``<prefix>{<tenant>}:tokens``   hash ``level``, ``ts``: the TPM bucket as of ``ts``
- ``<prefix>{<tenant>}:requests`` hash ``level``, ``ts``: the RPM bucket as of ``ts``
- ``<prefix>{<tenant>}:holds``    sorted set, member = reservation id, score = hold expiry

A missing bucket reads as full, so each bucket key expires a margin after it would be full again
and each hold set a margin after its last hold expires: idle tenants leave nothing behind.
Numbers travel as strings both ways, because Redis truncates a Lua number reply to an integer.

Every request makes two of these calls (reserve, then reconcile), so they go over one
connection that all of them share, pipelined (``core/redis_pipe.py``): through redis-py's pool
they cost the gateway 2.5 to 3.4 times the CPU (``python -m bench.quota_store_calls``).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, TypeVar

from admission.plans import QuotaLimits
from admission.quota import (
    Denial,
    LimitKind,
    QuotaSnapshot,
    Reservation,
    check_reserve_args,
    check_used_tokens,
)
from admission.quota_memory import pick_denial, snapshot_from_levels
from admission.redis_conn import bounded
from core.ids import random_hex
from core.redis_pipe import LuaScript, PipelinedRedis

_T = TypeVar("_T")

# Shared by every script. -1 capacity means unlimited (its level is then unused).
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
-- How long a key outlives the moment it would read the same as a missing one.
local margin_ms = 120000

local function fmt(x) return string.format('%.17g', x) end

local function level(key, cap)
  if cap < 0 then return 0 end
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  local elapsed = math.max(0, now - tonumber(v[2]))
  -- min() also trims a level left above a capacity that has since been lowered.
  return math.min(cap, tonumber(v[1]) + elapsed * cap / 60)
end

local function save(key, lvl, cap)
  redis.call('HSET', key, 'level', fmt(lvl), 'ts', fmt(now))
  local full_ms = 0
  if cap > 0 then full_ms = (cap - lvl) * 60000 / cap end
  redis.call('PEXPIRE', key, math.ceil(full_ms + margin_ms))
end
"""

# KEYS: tokens, requests, holds. ARGV: tpm, rpm, max_concurrent, tokens, hold_s, reservation id.
# Reply: granted -> {1, token level, request level, holds}; denied -> {0, token level,
# request level, holds, tokens wait, requests wait, concurrency wait}, each wait '' (passed),
# 'never' or seconds. Nothing is written on denial but the removal of expired holds.
_RESERVE = """
local tpm, rpm, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tokens, hold_s = tonumber(ARGV[4]), tonumber(ARGV[5])

local function wait(lvl, need, cap)
  if cap < 0 or lvl >= need then return '' end
  if need > cap or cap == 0 then return 'never' end
  return fmt((need - lvl) * 60 / cap)
end

local tl, rl = level(KEYS[1], tpm), level(KEYS[2], rpm)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(now))
local held = redis.call('ZCARD', KEYS[3])
local tw, rw, cw = wait(tl, tokens, tpm), wait(rl, 1, rpm), ''
if maxc >= 0 and held >= maxc then
  if maxc == 0 then
    cw = 'never'
  else
    -- Enough holds must expire to free one slot: more than one if the limit was lowered.
    local e = redis.call('ZRANGE', KEYS[3], held - maxc, held - maxc, 'WITHSCORES')
    cw = fmt(tonumber(e[2]) - now)
  end
end
if tw ~= '' or rw ~= '' or cw ~= '' then
  return {0, fmt(tl), fmt(rl), held, tw, rw, cw}
end

if tpm >= 0 then
  tl = tl - tokens
  save(KEYS[1], tl, tpm)
end
if rpm >= 0 then
  rl = rl - 1
  save(KEYS[2], rl, rpm)
end
-- Holds are kept even without a concurrency limit: the snapshot reports them.
redis.call('ZADD', KEYS[3], fmt(now + hold_s), ARGV[6])
local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
redis.call('PEXPIRE', KEYS[3], math.ceil((tonumber(last[2]) - now) * 1000 + margin_ms))
return {1, fmt(tl), fmt(rl), held + 1}
"""

# KEYS: tokens, requests, holds. ARGV: tpm, refund (reserved - used, may be negative),
# reservation id, rpm, request refund (1 when the request never ran, else 0).
# Settled even when the hold already expired: a long request's real usage still counts.
_RECONCILE = """
local tpm, refund = tonumber(ARGV[1]), tonumber(ARGV[2])
local rpm, request_refund = tonumber(ARGV[4]), tonumber(ARGV[5])
redis.call('ZREM', KEYS[3], ARGV[3])
if tpm >= 0 and refund ~= 0 then
  save(KEYS[1], math.min(tpm, level(KEYS[1], tpm) + refund), tpm)
end
if rpm >= 0 and request_refund ~= 0 then
  save(KEYS[2], math.min(rpm, level(KEYS[2], rpm) + request_refund), rpm)
end
return 1
"""

# KEYS: tokens, requests, holds. ARGV: tpm, rpm. Reply: {token level, request level, live holds}.
_SNAPSHOT = """
local tl = level(KEYS[1], tonumber(ARGV[1]))
local rl = level(KEYS[2], tonumber(ARGV[2]))
return {fmt(tl), fmt(rl), redis.call('ZCOUNT', KEYS[3], '(' .. fmt(now), '+inf')}
"""

_WAIT_KINDS = (LimitKind.TOKENS, LimitKind.REQUESTS, LimitKind.CONCURRENCY)


class RedisQuotaStore:
    """``QuotaStore`` in Redis, shared by every gateway replica pointed at the same server."""

    answers_at_once: bool = False

    def __init__(
        self, url: str, *, key_prefix: str = "tandem:quota:", timeout_s: float = 0.5
    ) -> None:
        self._redis = PipelinedRedis(url, timeout_s)
        self._prefix = key_prefix
        # Bounds a whole call (connect, EVALSHA, the script-cache fallback after a restart),
        # where ``timeout_s`` bounds each step alone.
        self._deadline_s = 2 * timeout_s
        self._reserve = LuaScript(_PRELUDE + _RESERVE)
        self._reconcile = LuaScript(_PRELUDE + _RECONCILE)
        self._snapshot = LuaScript(_PRELUDE + _SNAPSHOT)

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, hold_s: float
    ) -> Reservation | Denial:
        """Atomically take one request, ``tokens`` tokens and a concurrency hold that expires
        after ``hold_s`` seconds, or nothing."""
        check_reserve_args(tokens, hold_s)
        reservation_id = random_hex()
        args = [
            *_capacities(limits),
            _cap(limits.max_concurrent),
            str(tokens),
            repr(float(hold_s)),
            reservation_id,
        ]
        reply: list[Any] = await self._run(
            self._redis.evalsha(self._reserve, self._keys(tenant_id), args)
        )
        snapshot = snapshot_from_levels(limits, float(reply[1]), float(reply[2]), int(reply[3]))
        if int(reply[0]) == 1:
            return Reservation(
                tenant_id=tenant_id,
                reservation_id=reservation_id,
                tokens=tokens,
                snapshot=snapshot,
            )
        failures = [
            (kind, None if wait == "never" else float(wait))
            for kind, wait in zip(_WAIT_KINDS, reply[4:7], strict=True)
            if wait != ""
        ]
        denial = pick_denial(failures, snapshot)
        if denial is None:  # the script denies only with a failed limit; a mismatch is a bug
            raise RuntimeError(f"quota script denied without a failed limit: {reply!r}")
        return denial

    async def reconcile(
        self, reservation: Reservation, limits: QuotaLimits, used_tokens: int, *, ran: bool = True
    ) -> None:
        """Settle a reservation against real usage and release its concurrency hold; with
        ``ran=False`` also give the request unit back."""
        check_used_tokens(used_tokens)
        args = [
            _cap(limits.tpm),
            str(reservation.tokens - used_tokens),
            reservation.reservation_id,
            _cap(limits.rpm),
            "0" if ran else "1",
        ]
        await self._run(
            self._redis.evalsha(self._reconcile, self._keys(reservation.tenant_id), args)
        )

    async def snapshot(self, tenant_id: str, limits: QuotaLimits) -> QuotaSnapshot:
        """The tenant's current state, without taking anything."""
        reply: list[Any] = await self._run(
            self._redis.evalsha(self._snapshot, self._keys(tenant_id), _capacities(limits))
        )
        return snapshot_from_levels(limits, float(reply[0]), float(reply[1]), int(reply[2]))

    async def forget(self, tenant_id: str) -> None:
        """Drop every counter of a deleted tenant."""
        await self._run(self._redis.call("DEL", *self._keys(tenant_id)))

    async def aclose(self) -> None:
        """Close the connection."""
        await self._redis.aclose()

    def _keys(self, tenant_id: str) -> list[str]:
        base = f"{self._prefix}{{{tenant_id}}}"
        return [f"{base}:tokens", f"{base}:requests", f"{base}:holds"]

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await bounded(call, self._deadline_s, "quota store")


def _cap(limit: int | None) -> str:
    return "-1" if limit is None else str(limit)


def _capacities(limits: QuotaLimits) -> list[str]:
    return [_cap(limits.tpm), _cap(limits.rpm)]
