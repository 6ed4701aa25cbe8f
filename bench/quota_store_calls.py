"""What the shared quota store's two calls a request cost a gateway process's CPU.

    python -m bench.quota_store_calls [--concurrency 1,64] [--pairs 20000]

With several gateway processes every request reserves its quota and settles it in Redis:
two Lua script calls (``admission/quota_redis.py``). ``bench.overhead --targets
tandem-colocated,tandem-redis`` shows what that step costs a whole request; this shows the
calls alone, as CPU seconds of this process per reserve-and-settle pair, with ``--concurrency``
pairs at a time on uvloop (pin it to one core with ``taskset`` for steady figures), against a
``redis-server`` started as ``tandem up`` starts one (a unix socket):

- ``RedisQuotaStore``: the store as the gateway calls it (redis-py over a blocking pool of
  connections, each call bounded);
- ``one pipelined connection``: the same two scripts, sent by every caller over one shared
  connection, the commands of one turn of the event loop written together and each reply
  matched in order (Redis answers a connection in order), parsed by hiredis. No timeouts, no
  reconnection, no script reload: the floor of what the two calls can cost a client, not a
  store to use.

Figures, never assertions: compare runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import hiredis
import uvloop

from admission.plans import QuotaLimits
from admission.quota import Reservation
from admission.quota_redis import _PRELUDE, _RECONCILE, _RESERVE, RedisQuotaStore
from gateway.assembly.redis_server import OwnedRedis

_LIMITS = QuotaLimits(tpm=10**9, rpm=10**9, max_concurrent=None)
_TENANTS = 4
_RESERVED, _USED = 100, 50


class _Pipelined(asyncio.Protocol):
    """One connection every caller shares (see the module's docstring: a floor, not a store)."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(encoding="utf-8")
        self._replies: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._unsent: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while (reply := self._reader.gets()) is not False:
            self._replies.popleft().set_result(reply)

    def call(self, *args: str) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        self._replies.append(reply)
        if not self._unsent:
            loop.call_soon(self._write)
        self._unsent.append(hiredis.pack_command(cast(Any, args)))  # its stub wants a 1-tuple
        return reply

    def _write(self) -> None:
        assert self._transport is not None
        unsent, self._unsent = self._unsent, []
        self._transport.writelines(unsent)


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


async def _pipelined_pair_cost(socket_path: str, concurrency: int, pairs: int) -> float:
    loop = asyncio.get_running_loop()
    transport, conn = await loop.create_unix_connection(_Pipelined, socket_path)
    reserve = await conn.call("SCRIPT", "LOAD", _PRELUDE + _RESERVE)
    reconcile = await conn.call("SCRIPT", "LOAD", _PRELUDE + _RECONCILE)
    limits = [str(_LIMITS.tpm), str(_LIMITS.rpm)]

    async def pair(i: int) -> None:
        base = f"tandem:quota:{{bench-{i % _TENANTS}}}"
        keys = [f"{base}:tokens", f"{base}:requests", f"{base}:holds"]
        reservation_id = f"{i:032x}"
        granted = await conn.call(
            "EVALSHA", reserve, "3", *keys, *limits, "-1", str(_RESERVED), "60.0", reservation_id
        )
        assert granted[0] == 1
        await conn.call(
            "EVALSHA", reconcile, "3", *keys, limits[0], str(_RESERVED - _USED), reservation_id,
            limits[1], "0",
        )  # fmt: skip

    try:
        return await _cpu_per_pair(pair, concurrency, pairs)
    finally:
        transport.close()


async def _run(levels: list[int], pairs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-quota-calls-") as tmp:
        redis = OwnedRedis(Path(tmp) / "redis")
        await redis.start()
        try:
            print(f"CPU per reserve + settle pair (us), {pairs} pairs a level")
            print(
                f"{'pairs at a time':>15} {'RedisQuotaStore':>16} {'one pipelined connection':>25}"
            )
            for concurrency in levels:
                store = await _store_pair_cost(redis.url, concurrency, pairs)
                floor = await _pipelined_pair_cost(str(redis.socket_path), concurrency, pairs)
                print(f"{concurrency:>15} {store:>16.1f} {floor:>25.1f}")
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
