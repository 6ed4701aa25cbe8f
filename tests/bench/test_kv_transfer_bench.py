"""bench.kv_transfer's pure parts: the routing policies it compares, its request plan, and the
arithmetic of its table. The measurements themselves need live vLLM workers."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from bench.kv_transfer import affinity
from bench.kv_transfer.affinity import Workload, affinity_policy, round_robin_policy
from bench.kv_transfer.common import SplitTiming
from bench.kv_transfer.transfer import SizeRow
from bench.stats import percentile
from core.messages import WorkerRole
from kv_transfer.decider import DeciderConfig
from workers.registry import Worker


def workers(count: int = 2) -> list[Worker]:
    return [Worker(f"prefill-{i}", WorkerRole.PREFILL, f"u{i}", healthy=True) for i in range(count)]


def body(system: str, question: str = "q") -> dict[str, Any]:
    return affinity.one_token("m", system, question)


def test_round_robin_takes_turns_whatever_the_prompt() -> None:
    pool, pick = workers(), round_robin_policy()
    chosen = [pick(pool, body("same system prompt")).name for _ in range(4)]
    assert chosen == ["prefill-0", "prefill-1", "prefill-0", "prefill-1"]


def test_affinity_keeps_a_system_prompt_on_one_worker_and_spreads_prompts() -> None:
    pool, pick = workers(), affinity_policy(DeciderConfig())
    for group in range(20):
        system = f"system prompt {group} " * 20
        assert len({pick(pool, body(system, f"q{i}")).name for i in range(5)}) == 1
    spread = Counter(pick(pool, body(f"system prompt {g} " * 20)).name for g in range(20))
    assert set(spread) == {"prefill-0", "prefill-1"}


def test_affinity_yields_to_load_past_the_slack() -> None:
    pool, pick = workers(), affinity_policy(DeciderConfig(affinity_max_extra_load=2))
    system = "a shared system prompt " * 20
    preferred = pick(pool, body(system))
    other = next(worker for worker in pool if worker is not preferred)
    preferred.num_outstanding = 2
    assert pick(pool, body(system)) is preferred  # 2 more in flight: within the slack
    preferred.num_outstanding = 3
    assert pick(pool, body(system)) is other


async def test_the_plan_shares_each_system_prompt_and_is_shuffled_by_the_seed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def filler(_session: object, _url: str, _model: str, num_tokens: int) -> str:
        return "word " * num_tokens

    monkeypatch.setattr(affinity, "filler_of", filler)
    load = Workload(groups=3, per_group=4, prefix_tokens=8, question_tokens=2, concurrency=1)

    async def group_order(seed: int) -> list[int]:
        """The group of each request in sending order (prompts are fresh on every call)."""
        requests = await affinity.bodies(None, "u", "m", replace(load, seed=seed))  # type: ignore[arg-type]
        systems = Counter(request["messages"][0]["content"] for request in requests)
        assert sorted(systems.values()) == [4, 4, 4]
        assert len({request["messages"][1]["content"] for request in requests}) == 12
        assert all(request["max_tokens"] == 1 for request in requests)
        firsts = list(dict.fromkeys(r["messages"][0]["content"] for r in requests))
        return [firsts.index(r["messages"][0]["content"]) for r in requests]

    order = await group_order(0)
    assert order != sorted(order), "groups are interleaved, not sent one after another"
    assert await group_order(0) == order
    assert await group_order(1) != order


def test_split_timing_and_table_arithmetic() -> None:
    assert SplitTiming(prefill_leg_s=0.5, ttft_s=0.75, arrivals=[]).handoff_s == 0.25
    row = SizeRow(
        tokens=290, kv_bytes=17_694_720, xfer_s=0.005, memcpy_s=0.00125, prefill_leg_s=0.54,
        handoff_s=0.119, ttft_split_s=0.682, ttft_coloc_s=0.51,
    )  # fmt: skip
    assert row.render().split() == [
        "290", "17.7", "5.0", "3.54", "1.25", "4.0", "682", "540", "119", "510",
    ]  # fmt: skip
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([], 50) != percentile([], 50)  # nan
