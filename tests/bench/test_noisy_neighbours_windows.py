"""bench/noisy_neighbours.py's windows, on the fake stack: a flooded window in which the load
generator stalls is kept but not reported, and the next one is measured; each window carries the
host's line. (The flood's figures come from the real stack: tests/e2e/test_noisy_neighbours.py.)"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import openai
import pytest

from bench import noisy_neighbours
from bench.noisy_neighbours import LightLoad, flood
from tests.gateway.conftest import ADMIN_KEY, MODEL, make_fake_stack

STALL_S = 1.2
"""Longer than the flood's ``max_stall_s`` below: the first flooded window's blocked loop."""


async def test_a_stalled_window_is_discarded_and_the_next_one_measured(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    phases = itertools.count(1)
    real_light_phase = noisy_neighbours.light_phase

    async def light_phase(client: openai.AsyncOpenAI, *args: Any) -> LightLoad:
        if next(phases) == 2:  # the unloaded phase is the first; then the first flooded window
            await asyncio.sleep(0.05)  # the stall watcher is sleeping when the loop blocks
            time.sleep(STALL_S)  # noqa: ASYNC251  # the generator's stall being simulated
        return await real_light_phase(client, *args)

    monkeypatch.setattr(noisy_neighbours, "light_phase", light_phase)
    async with make_fake_stack() as stack:
        result = await flood(
            stack.base_url, ADMIN_KEY, MODEL, streams=2, output_tokens=4,
            duration_s=1.0, warmup_s=0.2, max_stall_s=1.0, max_windows=4, settle_s=0.1,
        )  # fmt: skip

    first, *_ = result.windows
    assert result.discarded[0] is first and first.longest_stall_s >= STALL_S - 0.05
    assert len(result.windows) >= 2 and result.measured is result.windows[-1]
    assert result.measured.longest_stall_s < 1.0  # a window after it is reported
    assert result.measured.start > first.end  # ... measured anew, after the stalled one
    assert result.served == {
        name: load.served_in(result.measured.start, result.measured.end)
        for name, load in result.heavy.items()
    }
    assert all(window.host.startswith("CPU steal ") for window in result.windows)
    assert result.measured.flooded.ttfts_s


async def test_the_last_window_is_reported_when_every_one_stalls() -> None:
    async with make_fake_stack() as stack:
        result = await flood(
            stack.base_url, ADMIN_KEY, MODEL, streams=2, output_tokens=4,
            duration_s=0.5, warmup_s=0.1, max_stall_s=0.0, max_windows=2, settle_s=0.1,
        )  # fmt: skip
    assert len(result.windows) == 2 and result.discarded == result.windows[:1]
    for load in result.heavy.values():
        assert not load.errors and all(s.completion_tokens for s in load.streams)
