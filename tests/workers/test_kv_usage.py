"""KvUsageWatcher writes each decode worker's KV-cache usage on its record; DecodeCapacity
counts the workers under the pool's watermark from those records, and a draining worker as the
slots its requests still hold."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from core.messages import WorkerRole
from tests.fakes.fake_engine import FakeEngine
from tests.server_process import free_port
from workers.capacity import DecodeCapacity
from workers.kv_usage import KvUsageWatcher, parse_kv_usage
from workers.pool import PoolConfig, WorkerPool


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    fake = await FakeEngine("m", role="decode").start()
    try:
        yield fake
    finally:
        await fake.aclose()


def decode_pool(*urls: str, kv_watermark: float = 0.9) -> WorkerPool:
    """A pool that is never started: tests set health by hand."""
    pool = WorkerPool(PoolConfig(WorkerRole.DECODE, external_urls=urls, kv_watermark=kv_watermark))
    for worker in pool.workers:
        worker.healthy = True
    return pool


async def test_the_watcher_writes_usage_on_the_worker_and_clears_what_it_cannot_read(
    engine: FakeEngine,
) -> None:
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pool = decode_pool(engine.base_url, engine.base_url, gone)
    read, unhealthy, unreadable = pool.workers
    unhealthy.healthy = False
    for worker in pool.workers:
        worker.kv_usage = 0.5  # stale figures from an earlier round
    engine.kv_usage_override = 0.75
    async with aiohttp.ClientSession() as session:
        watcher = KvUsageWatcher(session, pool, interval_s=0.05)
        await watcher.poll_once()
        assert (read.kv_usage, unhealthy.kv_usage, unreadable.kv_usage) == (0.75, None, None)

        engine.kv_usage_override = 0.97
        await watcher.start()  # the loop keeps the record current
        try:
            for _ in range(200):
                if read.kv_usage == 0.97:
                    break
                await asyncio.sleep(0.01)
            assert read.kv_usage == 0.97
            assert pool.pick() is unreadable  # read is KV-full now; unknown counts as room
        finally:
            await watcher.aclose()
    assert read.kv_usage is None  # nobody keeps it current any more


async def test_capacity_counts_healthy_workers_under_the_pools_watermark() -> None:
    pool = decode_pool("http://d0", "http://d1", "http://d2", kv_watermark=0.9)
    d0, d1, d2 = pool.workers
    capacity = DecodeCapacity(pool, max_in_flight_per_worker=4)
    assert capacity.capacity() == 12  # usage unknown everywhere: room
    d0.kv_usage, d1.kv_usage = 0.9, 0.89
    assert capacity.capacity() == 8  # at the watermark is full
    d2.healthy = False
    assert capacity.capacity() == 4
    d1.kv_usage = 0.95
    assert capacity.capacity() == 0
    assert pool.pick() is d0  # none has room: picking still answers (the least-loaded)


def test_parse_kv_usage_ignores_a_bare_name_and_other_gauges() -> None:
    assert parse_kv_usage("vllm:kv_cache_usage_perc\nvllm:kv_cache_usage_perc 0.5\n") == 0.5
    assert parse_kv_usage("vllm:kv_cache_usage_perc_max 0.9\n") is None


def test_a_draining_worker_counts_only_the_slots_its_requests_hold() -> None:
    pool = decode_pool("http://d0", "http://d1", kv_watermark=0.9)
    staying, leaving = pool.workers
    capacity = DecodeCapacity(pool, max_in_flight_per_worker=4)
    leaving.draining = True
    assert capacity.capacity() == 4  # idle and leaving: no slot, never its full 4
    leaving.num_outstanding = 3
    assert capacity.capacity() == 4 + 3  # its requests keep theirs until they end
    leaving.num_outstanding = 6  # more than a worker's share (admitted before a restart)
    assert capacity.capacity() == 4 + 4
    leaving.kv_usage = 0.99  # KV-full or not, its running requests hold their slots
    assert capacity.capacity() == 4 + 4
    with leaving.lease():
        assert capacity.capacity() == 4 + 4
    leaving.num_outstanding = 1
    assert capacity.capacity() == 4 + 1
    staying.kv_usage = 0.95
    assert capacity.capacity() == 0 + 1
    staying.kv_usage, staying.healthy = None, False
    assert capacity.capacity() == 0 + 1


def test_a_draining_worker_counts_at_most_per_worker_even_when_healthy_with_room() -> None:
    pool = decode_pool("http://d0", kv_watermark=0.9)
    (worker,) = pool.workers
    capacity = DecodeCapacity(pool, max_in_flight_per_worker=4)
    worker.num_outstanding = 2
    assert capacity.capacity() == 4  # in rotation: all its slots, whatever it runs
    worker.draining = True
    assert capacity.capacity() == 2
    worker.num_outstanding = 0
    assert capacity.capacity() == 0
