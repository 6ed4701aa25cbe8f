"""The planner's load read from the gateway's per-version windows."""

from __future__ import annotations

import pytest

from planner.windows_source import WindowsLoadSource
from traffic.windows import RequestFigures, VersionWindows


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ended(ttft_s: float, input_tokens: int, output_tokens: int) -> RequestFigures:
    return RequestFigures(
        ttft_s=ttft_s, itl_s=0.02, e2e_s=1.0, error=None, output_tokens=output_tokens,
        finish_reason="stop", moderation=None, input_tokens=input_tokens,
    )  # fmt: skip


async def test_rate_lengths_and_latencies_of_the_window() -> None:
    clock = Clock()
    windows = VersionWindows(horizon_s=600, bucket_s=1, clock=clock)
    for i in range(30):  # 30 requests over the last 30 s
        clock.now = 1000.0 + i
        windows.observe("v1", _ended(0.1 + 0.01 * (i % 3), 500, 100))
    load, latency = await WindowsLoadSource(windows).interval("v1", 30)
    assert load.request_rate == 1.0
    assert (load.input_tokens, load.output_tokens) == (500, 100)
    assert latency.ttft_s == pytest.approx(0.11)
    assert latency.itl_s == pytest.approx(0.02)


async def test_no_request_is_no_load_and_no_latency() -> None:
    source = WindowsLoadSource(VersionWindows(horizon_s=600, bucket_s=1, clock=Clock()))
    load, latency = await source.interval("v1", 30)
    assert load.request_rate == 0 and latency.ttft_s is None and latency.itl_s is None
