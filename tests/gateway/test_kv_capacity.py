"""The decode workers' KV-cache usage as a capacity signal: a full worker takes nothing new."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from workers.kv_usage import parse_kv_usage

QUESTION = [{"role": "user", "content": "hello"}]


def test_parse_kv_usage_reads_the_gauge_only() -> None:
    text = (
        "# HELP vllm:kv_cache_usage_perc KV-cache usage.\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75\n'
        "vllm:kv_cache_usage_perc_other 0.99\n"
    )
    assert parse_kv_usage(text) == 0.75
    assert parse_kv_usage("vllm:num_requests_running 3\n") is None


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[FakeStack]:
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        kv_usage_poll_s=0.05,
    )
    async with make_fake_stack(access=access, pool_options={"kv_watermark": 0.9}) as fake_stack:
        yield fake_stack


async def test_a_worker_with_a_full_kv_cache_holds_requests_in_the_queue(stack: FakeStack) -> None:
    stack.decode.kv_usage_override = 0.97
    await _until_gauge_reads(stack, "tandem_admission_capacity", "0.0")  # the watcher saw it
    waiting = asyncio.create_task(
        stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    )
    await _until_gauge_reads(stack, "tandem_admission_queued", "1.0")
    assert not waiting.done()
    assert stack.decode.stats.num_requests == 0

    stack.decode.kv_usage_override = 0.5  # room again: the next poll releases the queue
    reply = await asyncio.wait_for(waiting, timeout=5)
    assert reply.choices[0].message.content
    assert stack.decode.stats.num_requests == 1


async def _until_gauge_reads(stack: FakeStack, name: str, value: str) -> None:
    async def read() -> str:
        text = (await stack.admin.get("/metrics")).text
        [line] = [ln for ln in text.splitlines() if ln.startswith(f"{name} ")]
        return line.split()[1]

    deadline = asyncio.get_running_loop().time() + 10
    while await read() != value:
        assert asyncio.get_running_loop().time() < deadline, f"{name} never read {value}"
        await asyncio.sleep(0.05)


async def test_an_admitted_request_is_routed_past_a_worker_over_the_watermark(
    tmp_path: Path,
) -> None:
    # Two idle decode workers: least-loaded picking alone would take the first listed one.
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        kv_usage_poll_s=0.05,
    )
    async with make_fake_stack(
        num_decode=2, access=access, pool_options={"kv_watermark": 0.9}
    ) as stack:
        full, roomy = stack.decodes
        full.kv_usage_override = 0.97
        # The watcher saw it: capacity is one worker's 32 slots, not two workers' 64.
        await _until_gauge_reads(stack, "tandem_admission_capacity", "32.0")
        for _ in range(3):
            await stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        assert (full.stats.num_requests, roomy.stats.num_requests) == (0, 3)
