"""bench/loop_lag.py: a blocked event loop shows up as one long lag; what was measured outlives
``aclose``."""

from __future__ import annotations

import asyncio
import time

from bench.loop_lag import LoopLag


async def test_a_blocked_loop_is_one_stall_of_its_length() -> None:
    lag = LoopLag()
    lag.start()
    await asyncio.sleep(0.05)  # the watcher is sleeping when the loop blocks
    time.sleep(0.3)  # noqa: ASYNC251  # the stall being measured
    await asyncio.sleep(0.05)
    await lag.aclose()
    measured = len(lag.lags_s)

    assert 0.28 <= lag.longest_s < 1.0
    assert lag.late_s() >= lag.longest_s
    assert lag.late_s(at_least_s=10.0) == 0.0
    await lag.aclose()  # idempotent, and nothing more is measured
    await asyncio.sleep(0.05)
    assert len(lag.lags_s) == measured


def test_nothing_measured_is_no_stall() -> None:
    lag = LoopLag()
    assert lag.longest_s == 0.0 and lag.late_s() == 0.0
