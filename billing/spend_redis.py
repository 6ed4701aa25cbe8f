"""Each tenant's spend this month in Redis, shared by every gateway process and replica.

One hash per month, ``<prefix>{<month>}:spend``: field = tenant, value = integer micro-units,
plus the field ``SEEDED`` (when the month was seeded from the ledger, Redis ``TIME`` in µs).
The hash exists only once seeded: an increment into a missing hash is refused (the reply says
so), so spend is never counted from zero after Redis lost its data; the caller seeds it from
the ledger database first. It expires ``EXPIRY_MARGIN_S`` after the month's end.

Every change is published on ``<prefix>spend`` (``PUBLISH`` inside the same script), so every
process's view follows the others' spend within Redis's delivery, not at a refresh:

- ``{"m": month, "t": tenant, "v": total, "s": source}`` after an increment or a repair
- ``{"m": month, "seeded": true, "s": source}`` after a seed (read the whole hash again)

Scripts, one round trip each: ``add`` (several tenants' increments at once), ``seed`` (only
if the month is missing), ``floor`` (raise counters that fell below the ledger's figures).
Connections follow ``admission/redis_conn.py`` (a sibling package billing cannot import): no
client retries, a blocking pool, every call bounded; any failure is ``SpendStoreUnavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError

from core.redis_conn import bounded, connect

_T = TypeVar("_T")

SEEDED = "~seeded"
"""The marker field (``~`` cannot start a tenant id the registry makes)."""
EXPIRY_MARGIN_S = 7 * 86_400
"""How long a month's hash outlives the month (stragglers, late reports)."""
MAX_CONNECTIONS = 16
"""Connections one process opens at most: one batched script per flush, plus the listener."""

# KEYS: the month's hash. ARGV: channel, source, month, expire_at_s, then tenant, micros pairs.
# Reply: false when the month is not seeded (nothing written), else the new totals, in order.
_ADD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local totals = {}
for i = 5, #ARGV, 2 do
  local v = redis.call('HINCRBY', KEYS[1], ARGV[i], ARGV[i + 1])
  totals[#totals + 1] = v
  redis.call('PUBLISH', ARGV[1], cjson.encode({m = ARGV[3], t = ARGV[i], v = v, s = ARGV[2]}))
end
redis.call('EXPIREAT', KEYS[1], ARGV[4])
return totals
"""

# KEYS: the month's hash. ARGV: channel, source, month, expire_at_s, then tenant, micros pairs.
# Reply: 1 when this call seeded the month, 0 when it was seeded already (nothing written).
_SEED = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], '"""
    + SEEDED
    + """', t[1] .. string.format('%06d', tonumber(t[2])))
for i = 5, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('EXPIREAT', KEYS[1], ARGV[4])
redis.call('PUBLISH', ARGV[1], cjson.encode({m = ARGV[3], seeded = true, s = ARGV[2]}))
return 1
"""
)

# KEYS: the month's hash. ARGV: channel, source, month, then tenant, floor pairs.
# Reply: -1 when the month is not seeded, else how many counters were raised.
_FLOOR = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local raised = 0
for i = 4, #ARGV, 2 do
  local floor = tonumber(ARGV[i + 1])
  if tonumber(redis.call('HGET', KEYS[1], ARGV[i]) or '0') < floor then
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
    redis.call('PUBLISH', ARGV[1], cjson.encode({m = ARGV[3], t = ARGV[i], v = floor, s = ARGV[2]}))
    raised = raised + 1
  end
end
return raised
"""


class SpendStoreUnavailable(Exception):
    """Redis could not be reached (or did not answer in time)."""


@dataclass(frozen=True, slots=True)
class SpendEvent:
    """One message of the spend channel."""

    month: str
    source: str
    tenant_id: str | None = None
    total_micros: int = 0
    seeded: bool = False
    """The month was (re)seeded: read it whole again."""


class RedisSpend:
    """Per-tenant monthly spend counters in Redis, and the channel their changes go out on."""

    def __init__(
        self, url: str, *, source: str, key_prefix: str = "tandem:budget:", timeout_s: float = 2.0
    ) -> None:
        """``source``: this process's name in the messages it publishes (it skips its own)."""
        self._url = url
        self.source = source
        self._prefix = key_prefix
        self._channel = f"{key_prefix}spend"
        self._timeout_s = timeout_s
        self._deadline_s = 2 * timeout_s
        self._redis = _connect(url, timeout_s)
        self._add = self._redis.register_script(_ADD)
        self._seed = self._redis.register_script(_SEED)
        self._floor = self._redis.register_script(_FLOOR)

    async def add(self, month: str, amounts: dict[str, int]) -> dict[str, int] | None:
        """Add ``amounts`` (tenant -> micros) to ``month``'s counters; the new totals, or None
        when the month is not seeded (nothing was added)."""
        tenants = sorted(amounts)
        args = [*self._head(month), str(_expire_at_s(month))]
        for tenant in tenants:
            args += [tenant, str(amounts[tenant])]
        reply: list[Any] | None = await self._run(self._add([self._key(month)], args))
        if reply is None:
            return None
        return {tenant: int(total) for tenant, total in zip(tenants, reply, strict=True)}

    async def seed(self, month: str, spend: dict[str, int]) -> bool:
        """Create ``month``'s counters with ``spend`` unless it exists; True if this call did."""
        args = [*self._head(month), str(_expire_at_s(month))]
        for tenant, micros in sorted(spend.items()):
            args += [tenant, str(micros)]
        return bool(await self._run(self._seed([self._key(month)], args)))

    async def floor(self, month: str, floors: dict[str, int]) -> bool:
        """Raise each tenant's counter to at least its floor; False when the month is not
        seeded (nothing written)."""
        args = self._head(month)
        for tenant, micros in sorted(floors.items()):
            args += [tenant, str(micros)]
        return int(await self._run(self._floor([self._key(month)], args))) >= 0

    async def read(self, month: str) -> dict[str, int] | None:
        """Every tenant's total in ``month``; None when the month is not seeded."""
        reply = await self._run(self._redis.hgetall(self._key(month)))
        raw = cast("dict[str, str]", reply)  # decode_responses=True
        if SEEDED not in raw:
            return None
        return {tenant: int(value) for tenant, value in raw.items() if tenant != SEEDED}

    async def events(self) -> AsyncIterator[SpendEvent | None]:
        """The channel's messages, after a None once subscribed (what was published before is
        not replayed: read the month then). Ends by raising ``SpendStoreUnavailable`` when the
        connection drops; cancel it to stop."""
        client = _connect(self._url, self._timeout_s, socket_timeout=False)
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            try:
                await self._run(pubsub.subscribe(self._channel))
            except SpendStoreUnavailable:
                raise
            yield None
            while True:
                try:
                    message = await pubsub.get_message(timeout=None)
                except (RedisError, OSError) as exc:
                    raise SpendStoreUnavailable(f"spend channel dropped: {exc}") from exc
                if message is not None and message["type"] == "message":
                    yield _event(message["data"])
        finally:
            await asyncio.shield(_close_pubsub(pubsub, client))

    async def aclose(self) -> None:
        """Release connections."""
        await self._redis.aclose()

    def _head(self, month: str) -> list[str]:
        return [self._channel, self.source, month]

    def _key(self, month: str) -> str:
        return f"{self._prefix}{{{month}}}:spend"

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await _bounded(call, self._deadline_s)


def _event(data: str) -> SpendEvent:
    body = orjson.loads(data)
    if body.get("seeded"):
        return SpendEvent(str(body["m"]), str(body["s"]), seeded=True)
    return SpendEvent(str(body["m"]), str(body["s"]), str(body["t"]), int(body["v"]))


def _expire_at_s(month: str) -> int:
    """``EXPIRY_MARGIN_S`` after the end of ``month`` (``YYYY-MM``), Unix seconds."""
    year, number = (int(part) for part in month.split("-"))
    end = datetime(year + number // 12, number % 12 + 1, 1, tzinfo=UTC)
    return int(end.timestamp()) + EXPIRY_MARGIN_S


def _connect(url: str, timeout_s: float, *, socket_timeout: bool = True) -> Redis:
    return connect(url, timeout_s, max_connections=MAX_CONNECTIONS, socket_timeout=socket_timeout)


async def _bounded(call: Awaitable[_T], deadline_s: float) -> _T:
    return await bounded(call, deadline_s, "spend store", SpendStoreUnavailable)


async def _close_pubsub(pubsub: Any, client: Redis) -> None:
    try:
        await pubsub.aclose()
    finally:
        await client.aclose()
