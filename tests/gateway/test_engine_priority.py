"""A tenant's band reaches the engine as vLLM's ``priority``, on both legs, decided by the
gateway alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from gateway.serving.gate import GateConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack

QUESTION = [{"role": "user", "content": "hello"}]


def _access(tmp_path: Path, engine_priority: bool) -> AccessConfig:
    return AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        gate=GateConfig(engine_priority=engine_priority),
    )


async def _legs_of(stack: FakeStack, key: str, **extra: Any) -> list[dict[str, Any]]:
    """The bodies the prefill and decode workers got for one chat request."""
    client = stack.client.with_options(api_key=key)
    await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, extra_body=extra or None
    )
    [leg1] = stack.prefill.stats.requests[-1:]
    [leg2] = stack.decode.stats.requests[-1:]
    return [leg1["body"], leg2["body"]]


@pytest.mark.parametrize(("band", "priority"), [("interactive", -1), ("standard", 0), ("batch", 1)])
async def test_both_legs_carry_the_bands_priority(tmp_path: Path, band: str, priority: int) -> None:
    async with make_fake_stack(access=_access(tmp_path, engine_priority=True)) as stack:
        key = await stack.new_tenant(f"t-{band}", band=band)
        legs = await _legs_of(stack, key)
    assert [leg["priority"] for leg in legs] == [priority, priority]


async def test_a_clients_own_priority_never_reaches_the_engine(tmp_path: Path) -> None:
    async with make_fake_stack(access=_access(tmp_path, engine_priority=True)) as stack:
        key = await stack.new_tenant("greedy", band="batch")
        legs = await _legs_of(stack, key, priority=-100)
    assert [leg["priority"] for leg in legs] == [1, 1]
    async with make_fake_stack(access=_access(tmp_path / "off", engine_priority=False)) as stack:
        key = await stack.new_tenant("greedy", band="interactive")
        legs = await _legs_of(stack, key, priority=-100)
    assert all("priority" not in leg for leg in legs)  # fcfs workers refuse a non-zero one
