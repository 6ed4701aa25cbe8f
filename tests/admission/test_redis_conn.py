"""``admission.redis_conn.bounded`` against a real Redis: a caller cancelled during a call always
ends cancelled. redis-py sometimes swallows a cancellation and returns normally; a background loop
of store calls (the rollout lease's renewal) then outlived its owner's ``aclose`` and hung a test
gateway's shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import random

from admission.quota import StoreUnavailable
from rollouts.lease import RedisLease


async def test_a_cancelled_caller_ends_cancelled_whenever_the_cancel_lands(redis_url: str) -> None:
    rng = random.Random(7)
    survived = 0
    for trial in range(100):
        lease = RedisLease(redis_url, name=f"cancel-{trial}", key_prefix="test:cancel:")

        async def renew_forever(lease: RedisLease = lease) -> None:
            while True:  # the shape of RolloutController._hold_lease
                with contextlib.suppress(StoreUnavailable):
                    await lease.acquire("holder", 5.0)
                await asyncio.sleep(0)

        task = asyncio.create_task(renew_forever())
        await asyncio.sleep(rng.random() * 0.01)  # lands anywhere inside or between calls
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:
            survived += 1
            task.cancel()
            await asyncio.wait({task}, timeout=2.0)
        await lease.aclose()
    assert survived == 0, f"{survived} of 100 cancelled loops kept running"
