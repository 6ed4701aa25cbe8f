"""A tenant's band, and its fair position in the band, reach the engine as vLLM's
``priority``, on both legs, decided by the gateway alone."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from admission.plans import PriorityBand
from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from gateway.serving.gate import GateConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack, wait_until

QUESTION: list[Any] = [{"role": "user", "content": "hello there"}]


def _access(tmp_path: Path, engine_priority: bool) -> AccessConfig:
    return AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        gate=GateConfig(engine_priority=engine_priority),
    )


async def _legs_of(
    stack: FakeStack, key: str, text: str = "hello", **extra: Any
) -> list[dict[str, Any]]:
    """The bodies the prefill and decode workers got for one chat request saying ``text``
    (streamed: the fair queue charges output as it streams)."""
    client = stack.client.with_options(api_key=key)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=20,
        stream=True,
        extra_body=extra or None,
    )
    async for _ in stream:
        pass
    legs = [
        leg["body"]
        for engine in (stack.prefill, stack.decode)
        for leg in engine.stats.requests
        if leg["body"]["messages"][-1]["content"] == text
    ]
    assert len(legs) == 2, legs
    return legs


def test_bands_never_overlap_and_positions_are_capped() -> None:
    assert [band.engine_priority() for band in PriorityBand] == [-100, 0, 100]
    assert PriorityBand.INTERACTIVE.engine_priority(5) == -95
    assert PriorityBand.INTERACTIVE.engine_priority(500) == -1  # still ahead of standard
    assert PriorityBand.STANDARD.engine_priority(99) == 99  # still ahead of batch
    with pytest.raises(ValueError, match="position"):
        PriorityBand.BATCH.engine_priority(-1)


@pytest.mark.parametrize(
    ("band", "priority"), [("interactive", -100), ("standard", 0), ("batch", 100)]
)
async def test_both_legs_carry_the_bands_priority(tmp_path: Path, band: str, priority: int) -> None:
    async with make_fake_stack(access=_access(tmp_path, engine_priority=True)) as stack:
        key = await stack.new_tenant(f"t-{band}", band=band)
        legs = await _legs_of(stack, key)
    assert [leg["priority"] for leg in legs] == [priority, priority]


async def test_a_clients_own_priority_never_reaches_the_engine(tmp_path: Path) -> None:
    async with make_fake_stack(access=_access(tmp_path, engine_priority=True)) as stack:
        key = await stack.new_tenant("greedy", band="batch")
        legs = await _legs_of(stack, key, priority=-1000)
    assert [leg["priority"] for leg in legs] == [100, 100]
    async with make_fake_stack(access=_access(tmp_path / "off", engine_priority=False)) as stack:
        key = await stack.new_tenant("greedy", band="interactive")
        legs = await _legs_of(stack, key, priority=-1000)
    assert all("priority" not in leg for leg in legs)  # the gateway alone decides


async def test_the_more_served_tenant_of_a_band_gets_the_larger_priority(tmp_path: Path) -> None:
    access = dataclasses.replace(
        _access(tmp_path, engine_priority=True), max_in_flight_per_worker=2
    )
    async with make_fake_stack(access=access) as stack:
        heavy = await stack.new_tenant("heavy", band="standard")
        light = await stack.new_tenant("light", band="standard")
        # heavy alone: position 0; its output (9 tokens, x2) puts it well past light's share.
        first = await _legs_of(stack, heavy, "first from heavy")
        # light's request holds its slot (its prefill leg is slow) while heavy's next one is
        # admitted next to it: both are active in the band, light is the less served.
        stack.prefill.first_token_delay_s = 1.5
        slow = asyncio.create_task(_legs_of(stack, light, "from light"))
        await wait_until(lambda: len(stack.prefill.stats.requests) == 2)
        await asyncio.sleep(0.05)  # its leg has read the delay
        stack.prefill.first_token_delay_s = 0.0
        second = await _legs_of(stack, heavy, "second from heavy")
        assert not slow.done()
        lights = await slow
    assert [leg["priority"] for leg in first] == [0, 0]
    assert [leg["priority"] for leg in lights] == [0, 0]
    assert [leg["priority"] for leg in second] == [1, 1]


async def _counter(stack: FakeStack, tenant: str) -> float:
    usage = (await stack.admin.get(f"/admin/v1/tenants/{tenant}/usage")).json()
    counter = usage["fairness_counter_here"]
    assert counter is not None, usage
    return float(counter)


@pytest.mark.parametrize("stream", [False, True])
async def test_output_is_charged_to_the_fair_queue_streamed_or_not(
    tmp_path: Path, stream: bool
) -> None:
    """VTC charges prompt + 2 x output whether the answer streams or comes whole: a tenant
    that never streams must not look less served than it is."""
    async with make_fake_stack(access=_access(tmp_path, engine_priority=True)) as stack:
        key = await stack.new_tenant("whole")
        client = stack.client.with_options(api_key=key)
        outputs = []
        counters = []
        for max_tokens in (2, 6):
            if stream:
                chunks = await client.chat.completions.create(
                    model=MODEL, messages=QUESTION, max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                usage = [chunk.usage async for chunk in chunks if chunk.usage][-1]
            else:
                answer = await client.chat.completions.create(
                    model=MODEL, messages=QUESTION, max_tokens=max_tokens
                )
                usage = answer.usage
            assert usage is not None
            outputs.append(usage.completion_tokens)
            counters.append(await _counter(stack, "whole"))
    # First request from 0: prompt + 2 x out1. Second: + prompt + 2 x out2 (no lift: the
    # tenant's counter stayed above its band's floor). So the prompt charge cancels out:
    prompt_charge = counters[0] - 2 * outputs[0]
    assert counters[1] - counters[0] - prompt_charge == pytest.approx(2 * outputs[1])
    assert prompt_charge > 0
