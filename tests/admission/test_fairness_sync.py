"""RedisFairnessSync against a real redis-server: two FairQueues stand for two gateway replicas
sharing one Redis. Fairness follows a tenant across replicas, the Lua script merges lifts by max
and adds charges, idle state expires, and an outage neither raises nor loses deltas."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
from redis.asyncio import Redis

from admission.fair_queue import FairQueue, QueueEntry
from admission.fairness_sync import RedisFairnessSync
from admission.plans import PriorityBand
from tests.redis_server import running_redis

WAIT_S = 10.0


def entry(tenant: str, *, prompt: int = 10, name: str = "") -> QueueEntry[str]:
    return QueueEntry(tenant, 1.0, PriorityBand.STANDARD, prompt, 0.0, None, name or tenant)


def serve(queue: FairQueue[str], tenant: str, prompt: int) -> None:
    queue.push(entry(tenant, prompt=prompt))
    queue.finish(queue.pop())


def pop_names(queue: FairQueue[str], n: int) -> list[str]:
    names = []
    for _ in range(n):
        popped = queue.pop()
        queue.finish(popped)
        names.append(popped.payload)
    return names


async def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {WAIT_S} s: {what}")
        await asyncio.sleep(0.02)


@pytest.fixture
def key_prefix() -> str:
    """Tests share the session's server; each keeps to its own keys."""
    return f"test-{uuid.uuid4().hex}:{{vtc}}:"


@pytest.fixture
async def replicas(
    redis_url: str, key_prefix: str
) -> AsyncIterator[list[tuple[FairQueue[str], RedisFairnessSync]]]:
    """Two replicas' queues, each with its own sync (not started) on the same Redis."""
    pairs = []
    for _ in range(2):
        queue: FairQueue[str] = FairQueue()
        pairs.append((queue, RedisFairnessSync(queue, redis_url, key_prefix=key_prefix)))
    yield pairs
    for _, sync in pairs:
        await sync.aclose()


async def test_a_tenant_served_on_one_replica_goes_after_its_share_on_another(
    replicas: list[tuple[FairQueue[str], RedisFairnessSync]],
) -> None:
    (one, sync_one), (two, sync_two) = replicas
    for _ in range(10):
        serve(one, "a", 100)  # a is served heavily through replica one
    assert await sync_one.sync()

    for i in range(3):
        two.push(entry("a", name=f"a{i}"))
        two.push(entry("b", name=f"b{i}"))
    head = two.peek()
    assert head is not None and head.payload == "a0"  # alone, replica two would serve a first
    assert await sync_two.sync()
    assert two.counter("a") == pytest.approx(1000.0)
    assert pop_names(two, 3) == ["b0", "b1", "b2"]


async def test_the_running_task_shares_counters_without_being_asked(
    replicas: list[tuple[FairQueue[str], RedisFairnessSync]],
) -> None:
    (one, sync_one), (two, sync_two) = replicas
    await sync_one.start()
    await sync_two.start()
    two.push(entry("a", name="a0"))
    two.push(entry("b", name="b0"))
    for _ in range(5):
        serve(one, "a", 100)
    await eventually(lambda: two.counter("a") == pytest.approx(500.0), "a's service reaches two")
    assert pop_names(two, 2) == ["b0", "a0"]


async def test_lifts_merge_by_max_and_charges_add_in_redis(
    replicas: list[tuple[FairQueue[str], RedisFairnessSync]],
) -> None:
    for queue, sync in replicas:
        queue.push(entry("big", prompt=500))
        queue.pop()  # big runs on; the band is empty with its floor at big's 500
        queue.push(entry("c"))  # a newcomer, lifted to 500 on both replicas
        assert await sync.sync()
    one, sync_one = replicas[0]
    assert await sync_one.sync()  # reads what replica two added
    assert one.counter("big") == pytest.approx(1000.0)  # served 500 on each replica
    assert one.counter("c") == pytest.approx(500.0)  # lifted to 500 on each: counted once


async def test_closing_shares_what_is_left(redis_url: str, key_prefix: str) -> None:
    queue: FairQueue[str] = FairQueue()
    sync = RedisFairnessSync(queue, redis_url, key_prefix=key_prefix, interval_s=3600.0)
    await sync.start()  # its first tick is an hour away
    serve(queue, "a", 60)
    await sync.aclose()  # a replica shutting down: its last deltas still count elsewhere
    assert await shared_counters(redis_url, key_prefix) == {"a": "60"}


async def test_idle_tenants_are_forgotten_and_a_tracking_replica_restores_them(
    redis_url: str, key_prefix: str
) -> None:
    queue: FairQueue[str] = FairQueue()
    sync = RedisFairnessSync(queue, redis_url, key_prefix=key_prefix, ttl_s=0.5)
    client: Redis = Redis.from_url(redis_url, decode_responses=True)
    try:
        queue.push(entry("idle", prompt=300))
        running = queue.pop()  # tracked while it runs, but nothing new is charged
        assert await sync.sync()
        assert await client.hget(f"{key_prefix}counters", "idle") == "300"
        first_written = await client.zscore(f"{key_prefix}touched", "idle")
        assert first_written is not None
        busy_until = time.monotonic() + 0.8
        while time.monotonic() < busy_until:  # another tenant keeps the keys alive
            serve(queue, "busy", 1)
            assert await sync.sync()
            await asyncio.sleep(0.05)
        assert await client.hget(f"{key_prefix}counters", "busy") is not None
        # "idle" went untouched for longer than the TTL: it was dropped from the shared hash,
        # and this replica, which still tracks it at 300, wrote it back on the next sync.
        rewritten = await client.zscore(f"{key_prefix}touched", "idle")
        assert rewritten is not None and rewritten > first_written + 0.4
        assert await client.hget(f"{key_prefix}counters", "idle") == "300"
        assert queue.counter("idle") == pytest.approx(300.0)
        queue.finish(running)
        await asyncio.sleep(0.6)  # now everything is idle: the keys expire
        assert await client.exists(f"{key_prefix}counters", f"{key_prefix}touched") == 0
    finally:
        await client.aclose()
        await sync.aclose()


async def test_an_outage_is_survived_and_its_deltas_are_applied_after_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with running_redis() as server:
        queue: FairQueue[str] = FairQueue()
        sync = RedisFairnessSync(queue, server.url, interval_s=0.02, timeout_s=0.5)
        try:
            queue.push(entry("steady", prompt=40))
            steady = queue.pop()  # tracked throughout: it runs until the end
            assert await sync.sync()
            assert await shared_counters(server.url) == {"steady": "40"}
            await sync.start()

            caplog.set_level(logging.WARNING, logger="tandem.admission")
            server.stop()
            serve(queue, "during", 70)  # served in the outage, then dropped from the queue
            assert queue.counter("during") is None
            await eventually(lambda: sync.in_outage, "the outage is noticed")
            assert not await sync.sync()  # never raises, however often it fails
            await asyncio.sleep(0.2)  # many more failed ticks
            warnings = [r for r in caplog.records if r.name == "tandem.admission"]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]

            await asyncio.to_thread(server.start)  # back, empty: no persistence
            await eventually(lambda: not sync.in_outage, "the sync recovers by itself")
            await asyncio.sleep(0.1)  # a few more ticks: the lost counter is written back
            counters = {t: float(c) for t, c in (await shared_counters(server.url)).items()}
            # The outage's deltas arrived: lifted to 40, then charged 70. Steady's counter, lost
            # with the restart, was written back from this replica's.
            assert counters == {"during": pytest.approx(110.0), "steady": pytest.approx(40.0)}
            queue.finish(steady)
        finally:
            await sync.aclose()


async def shared_counters(url: str, key_prefix: str = "tandem:{vtc}:") -> dict[str, str]:
    client: Redis = Redis.from_url(url, decode_responses=True)
    try:
        return await client.hgetall(f"{key_prefix}counters")  # type: ignore[no-any-return]
    finally:
        await client.aclose()
