"""Fairness across replicas: the VTC counters of every gateway replica shared through Redis.

Each replica's ``FairQueue`` records what it did to each tenant's counter (a ``CounterDelta``:
charges add, lifts merge by max). Every ``interval_s`` one Lua script round trip applies this
replica's deltas to the shared counters and returns the shared counters of every tenant the
replica tracks, which the queue then ``absorb``s. So a tenant served heavily through one replica
is behind its share on all of them, within about one interval.

Fairness never blocks admission: the queue always decides with its local counters, and while
Redis is unreachable the deltas pile up (merged, one per tenant) and go out when it is back. One
warning per outage, one note when it ends. A round trip that timed out after Redis ran the
script is sent again: the tenant is over-charged by that interval's service, once.

Keys (the ``{vtc}`` hash tag keeps both in one Redis Cluster slot, which the script needs):

- ``<prefix>counters`` hash tenant -> shared counter (weighted service; it only grows)
- ``<prefix>touched``  sorted set tenant -> Redis ``TIME`` of its last change

A tenant nobody charged or lifted for ``ttl_s`` is forgotten (a bounded batch per round trip),
and both keys expire ``ttl_s`` after the last change anywhere: idle state leaves nothing behind.
A replica still tracking a forgotten tenant pushes its counter back as a lift, as after a Redis
restart. Numbers travel as strings both ways (Redis truncates Lua numbers to integers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from admission.fair_queue import CounterDelta
from admission.quota import StoreUnavailable
from admission.redis_conn import bounded, connect

log = logging.getLogger("tandem.admission")

_T = TypeVar("_T")

# KEYS: counters, touched. ARGV: ttl ms, number of deltas n, n x (tenant, charged, at_least or
# ''), then the tenants to read. Reply: their counters, in order, nil where there is none.
_SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl_ms, n = tonumber(ARGV[1]), tonumber(ARGV[2])
local function fmt(x) return string.format('%.17g', x) end

local cutoff = fmt(now - ttl_ms / 1000)
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', cutoff, 'LIMIT', 0, 256)
for _, tenant in ipairs(stale) do
  redis.call('HDEL', KEYS[1], tenant)
  redis.call('ZREM', KEYS[2], tenant)
end

for i = 0, n - 1 do
  local tenant, at_least = ARGV[3 + 3 * i], ARGV[5 + 3 * i]
  local c = tonumber(redis.call('HGET', KEYS[1], tenant) or '0') + tonumber(ARGV[4 + 3 * i])
  if at_least ~= '' then c = math.max(c, tonumber(at_least)) end
  redis.call('HSET', KEYS[1], tenant, fmt(c))
  redis.call('ZADD', KEYS[2], fmt(now), tenant)
end
if n > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
  redis.call('PEXPIRE', KEYS[2], ttl_ms)
end

local reply = {}
for i = 3 + 3 * n, #ARGV do
  reply[#reply + 1] = redis.call('HGET', KEYS[1], ARGV[i])
end
return reply
"""


class SharedCounters(Protocol):
    """The side of a ``FairQueue`` a sync needs."""

    @property
    def counters(self) -> dict[str, float]:
        """Every tracked tenant's counter."""
        ...

    def enable_deltas(self) -> None:
        """Start recording changes."""
        ...

    def take_deltas(self) -> dict[str, CounterDelta]:
        """The changes since the last call."""
        ...

    def restore_deltas(self, deltas: dict[str, CounterDelta]) -> None:
        """Give back deltas that could not be shared."""
        ...

    def absorb(self, shared: dict[str, float | None]) -> None:
        """Adopt shared counters (None: the store has none)."""
        ...


class RedisFairnessSync:
    """Shares one ``FairQueue``'s counters through Redis every ``interval_s``. ``start`` /
    ``aclose``; ``sync`` runs one round trip now."""

    def __init__(
        self,
        queue: SharedCounters,
        url: str,
        *,
        interval_s: float = 0.1,
        key_prefix: str = "tandem:{vtc}:",
        ttl_s: float = 3600.0,
        timeout_s: float = 2.0,
    ) -> None:
        if not interval_s > 0:
            raise ValueError("RedisFairnessSync: interval_s must be > 0")
        if not ttl_s > 0:
            raise ValueError("RedisFairnessSync: ttl_s must be > 0")
        if not timeout_s > 0:
            raise ValueError("RedisFairnessSync: timeout_s must be > 0")
        # One round trip at a time needs one connection (admission/redis_conn.py says the rest).
        self._redis = connect(url, timeout_s, max_connections=1)
        self._script = self._redis.register_script(_SYNC)
        self._keys = [f"{key_prefix}counters", f"{key_prefix}touched"]
        self._queue = queue
        self._interval_s = interval_s
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._in_outage = False
        queue.enable_deltas()

    @property
    def in_outage(self) -> bool:
        """Whether the last round trip failed (the queue runs on local counters meanwhile)."""
        return self._in_outage

    async def start(self) -> None:
        """Begin syncing every ``interval_s``."""
        if self._task is not None or self._stopping.is_set():
            raise RuntimeError("fairness sync already started or closed")
        self._task = asyncio.create_task(self._loop(), name="fairness sync")
        self._task.add_done_callback(_report_crash)

    async def aclose(self) -> None:
        """Stop, share what is left (one last round trip, bounded by ``timeout_s``), and
        release the connection. The queue keeps recording; nobody takes its deltas any more."""
        self._stopping.set()
        task, self._task = self._task, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)  # a crash was logged already
        await self.sync()  # a replica shutting down: its last service still counts elsewhere
        await self._redis.aclose()

    async def sync(self) -> bool:
        """One round trip: apply this replica's deltas, absorb the shared counters. False when
        Redis was unreachable (the deltas are kept for the next round trip); never raises
        ``StoreUnavailable``."""
        async with self._lock:
            deltas = self._queue.take_deltas()
            tenant_ids = list(self._queue.counters)
            args: list[str] = [str(self._ttl_ms), str(len(deltas))]
            for tenant_id, delta in deltas.items():
                at_least = "" if delta.at_least is None else repr(delta.at_least)
                args += [tenant_id, repr(delta.charged), at_least]
            args += tenant_ids
            try:
                reply: list[Any] = await self._run(self._script(self._keys, args))
            except StoreUnavailable as exc:
                self._queue.restore_deltas(deltas)
                if not self._in_outage:
                    self._in_outage = True
                    log.warning("fairness sync failed, using local counters until back: %s", exc)
                return False
            if self._in_outage:
                self._in_outage = False
                log.info("fairness sync restored")
            shared = {
                tenant_id: None if value is None else float(value)
                for tenant_id, value in zip(tenant_ids, reply, strict=True)
            }
            self._queue.absorb(shared)
            return True

    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            if self._stopping.is_set():
                return  # aclose makes the last round trip
            await self.sync()

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await bounded(call, self._timeout_s, "fairness store")


def _report_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("fairness sync stopped: counters stay local", exc_info=exc)
