"""The one way Tandem's Redis stores connect and call: bounded, no blind retries. (The quota
store's two calls a request go over one shared, pipelined connection instead, under the same
rules: ``core/redis_pipe.py``.)

- No client-side retries: a blind retry of a script whose reply was lost would take, refund or
  create twice, and a dead store must answer at once. The pool still replaces connections a
  restarted server or a network reset closed, so the next call recovers by itself: over RESP2,
  because redis-py 8.1 skips that check under RESP3 (its default, with maintenance
  notifications on), and every pooled connection an outage closed then failed its next call
  after the store was back (tests/properties/test_quota_properties.py checks it).
- A blocking pool: a burst beyond its size waits its turn, where redis-py's default pool raises
  "Too many connections" (past 100 concurrent calls that turned a healthy store into 503s).
- Every call is bounded as a whole (connect, EVALSHA, the script-cache fallback after a
  restart); the socket timeouts bound each operation alone. Any failure is the caller's
  "store unavailable" error (each package has its own: ``admission.quota.StoreUnavailable``,
  ``billing.spend_redis.SpendStoreUnavailable``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

T = TypeVar("T")

MAX_CONNECTIONS = 256
"""Connections one store (one gateway) opens to Redis at most; a script runs in microseconds."""


def connect(
    url: str,
    timeout_s: float,
    *,
    max_connections: int = MAX_CONNECTIONS,
    socket_timeout: bool = True,
) -> Redis:
    """A client over a blocking pool with ``timeout_s`` socket and pool-wait timeouts
    (``socket_timeout=False``: reads wait as long as it takes, for a pub/sub listener that
    learns of a dead server from its connection dropping)."""
    pool = BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=timeout_s,
        socket_timeout=timeout_s if socket_timeout else None,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
        protocol=2,  # the pool checks a pooled connection before lending it (module docstring)
    )
    return Redis.from_pool(pool)


async def bounded(
    call: Awaitable[T], deadline_s: float, what: str, unavailable: type[Exception]
) -> T:
    """Await one Redis call within ``deadline_s``; any failure raises ``unavailable``.

    A cancellation that arrives during the call always ends in ``CancelledError``: redis-py
    sometimes swallows it, the call then returning normally (measured: 135 of 400 cancels of a
    loop of lease acquisitions), which left a background loop running after its owner
    cancelled it and hung a gateway's shutdown."""
    task = asyncio.current_task()
    cancels_before = task.cancelling() if task is not None else 0
    try:
        async with asyncio.timeout(deadline_s):
            result = await call
    except (RedisError, OSError, TimeoutError) as exc:
        if task is not None and task.cancelling() > cancels_before:
            raise asyncio.CancelledError from exc
        # TimeoutError is also asyncio.timeout's; OSError covers refused and reset connections.
        raise unavailable(f"{what} unreachable: {type(exc).__name__}: {exc}") from exc
    if task is not None and task.cancelling() > cancels_before:
        raise asyncio.CancelledError
    return result
