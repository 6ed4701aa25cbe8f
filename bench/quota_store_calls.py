"""What the shared quota store's two calls a request cost a gateway process's CPU.

    python -m bench.quota_store_calls [--concurrency 1,64] [--pairs 20000]

With several gateway processes every request reserves its quota and settles it in Redis:
two Lua script calls (``admission/quota_redis.py``). ``bench.overhead --targets
tandem-colocated,tandem-redis`` shows what that step costs a whole request; this shows the
calls alone, as CPU seconds of this process per reserve-and-settle pair, with ``--concurrency``
pairs at a time on uvloop (pin it to one core with ``taskset`` for steady figures; the Redis
follows it there), against a ``redis-server`` started as ``tandem up`` starts one:

- ``RedisQuotaStore``: the store as the gateway calls it, over one connection every caller
  shares, pipelined (``core/redis_pipe.py``);
- ``redis-py pool``: the same two scripts through redis-py's blocking pool of connections
  (``core/redis_conn.py``), each call bounded, as the store called them before.

Figures, never assertions: compare runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop

from admission.plans import QuotaLimits
from admission.quota import Reservation, StoreUnavailable
from admission.quota_redis import _PRELUDE, _RECONCILE, _RESERVE, RedisQuotaStore
from core.redis_conn import bounded, connect
from gateway.assembly.redis_server import OwnedRedis

_LIMITS = QuotaLimits(tpm=10**9, rpm=10**9, max_concurrent=None)
_TENANTS = 4
_RESERVED, _USED = 100, 50


async def _cpu_per_pair(
    pair: Callable[[int], Awaitable[None]], concurrency: int, pairs: int
) -> float:
    """Microseconds of this process's CPU per ``pair``, ``concurrency`` at a time, after one
    warm-up round."""
    await asyncio.gather(*(pair(i) for i in range(concurrency)))
    rounds = max(1, pairs // concurrency)
    started = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*(pair(i) for i in range(concurrency)))
    return (time.process_time() - started) / (rounds * concurrency) * 1e6


async def _store_pair_cost(url: str, concurrency: int, pairs: int) -> float:
    store = RedisQuotaStore(url, timeout_s=2.0)

    async def pair(i: int) -> None:
        reservation = await store.reserve(f"bench-{i % _TENANTS}", _LIMITS, _RESERVED, 60.0)
        assert isinstance(reservation, Reservation)
        await store.reconcile(reservation, _LIMITS, _USED)

    try:
        return await _cpu_per_pair(pair, concurrency, pairs)
    finally:
        await store.aclose()


async def _pooled_pair_cost(url: str, concurrency: int, pairs: int) -> float:
    redis = connect(url, 2.0)
    reserve = redis.register_script(_PRELUDE + _RESERVE)
    reconcile = redis.register_script(_PRELUDE + _RECONCILE)
    limits = [str(_LIMITS.tpm), str(_LIMITS.rpm)]

    async def pair(i: int) -> None:
        base = f"tandem:quota:{{bench-{i % _TENANTS}}}"
        keys = [f"{base}:tokens", f"{base}:requests", f"{base}:holds"]
        reservation_id = f"{i:032x}"
        args = [*limits, "-1", str(_RESERVED), "60.0", reservation_id]
        granted = await bounded(reserve(keys, args), 4.0, "bench", StoreUnavailable)
        assert int(granted[0]) == 1
        args = [limits[0], str(_RESERVED - _USED), reservation_id, limits[1], "0"]
        await bounded(reconcile(keys, args), 4.0, "bench", StoreUnavailable)

    try:
        return await _cpu_per_pair(pair, concurrency, pairs)
    finally:
        await redis.aclose()


async def _run(levels: list[int], pairs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-quota-calls-") as tmp:
        redis = OwnedRedis(Path(tmp) / "redis")
        await redis.start()
        try:
            print(f"CPU per reserve + settle pair (us), {pairs} pairs a level")
            print(f"{'pairs at a time':>15} {'RedisQuotaStore':>16} {'redis-py pool':>14}")
            for concurrency in levels:
                store = await _store_pair_cost(redis.url, concurrency, pairs)
                pooled = await _pooled_pair_cost(redis.url, concurrency, pairs)
                print(f"{concurrency:>15} {store:>16.1f} {pooled:>14.1f}")
        finally:
            await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quota_store_calls")
    parser.add_argument("--concurrency", default="1,64", help="pairs at a time, per level")
    parser.add_argument("--pairs", type=int, default=20_000, help="pairs measured per level")
    args = parser.parse_args(argv)
    levels = [int(level) for level in args.concurrency.split(",")]
    uvloop.run(_run(levels, args.pairs))


if __name__ == "__main__":
    main()
