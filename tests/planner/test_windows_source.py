"""The planner's load read from the gateway's per-version windows and backlog."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from core.messages import Endpoint
from core.models import ServedModel
from core.prompt import TokenEstimate
from core.request import Request
from planner.windows_source import WindowsLoadSource
from traffic.backlog import Backlog
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


def _waiting(backlog: Backlog, version: str, *prompt_tokens: int | None) -> ExitStack:
    """Requests of ``version`` in ``backlog`` until the returned stack closes (None: one with
    no estimate yet)."""
    model = ServedModel("m", 256, 0, version=version)
    stack = ExitStack()
    for tokens in prompt_tokens:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        request = Request.receive("r", Endpoint.CHAT, model, body)
        if tokens is not None:
            request.record_estimate(TokenEstimate(tokens, max_output_tokens=8, num_choices=1))
        stack.enter_context(backlog.waiting(request))
    return stack


async def test_the_backlog_is_the_prefill_backlog_and_the_waiting_requests() -> None:
    clock = Clock()
    windows, backlog = VersionWindows(horizon_s=600, bucket_s=1, clock=clock), Backlog()
    source = WindowsLoadSource(windows, backlog)
    with _waiting(backlog, "v1", 300, 200, None), _waiting(backlog, "v2", 9999):
        # No request has ended yet: the backlog alone.
        load, latency = await source.interval("v1", 30)
        assert (load.prefill_backlog_tokens, load.waiting_requests) == (500, 3)
        assert load.request_rate == 0 and latency.ttft_s is None
        for i in range(30):
            clock.now = 1000.0 + i
            windows.observe("v1", _ended(0.1, 500, 100))
        # Ended requests in the window: their rate and lengths, and the backlog beside them.
        load, _ = await source.interval("v1", 30)
        assert load.request_rate == 1.0 and (load.input_tokens, load.output_tokens) == (500, 100)
        assert (load.prefill_backlog_tokens, load.waiting_requests) == (500, 3)
    load, _ = await source.interval("v1", 30)
    assert (load.prefill_backlog_tokens, load.waiting_requests) == (0, 0)
    assert load.request_rate == 1.0


async def test_without_a_backlog_nothing_is_waiting() -> None:
    clock = Clock()
    windows = VersionWindows(horizon_s=600, bucket_s=1, clock=clock)
    windows.observe("v1", _ended(0.1, 500, 100))
    load, _ = await WindowsLoadSource(windows).interval("v1", 30)
    assert (load.prefill_backlog_tokens, load.waiting_requests) == (0, 0)


async def test_an_interval_shorter_than_a_bucket_reads_the_rate_the_bucket_saw() -> None:
    # One request a second into 10 s buckets; the planner asks for the last 3 s. The bucket
    # it reads holds 10 requests over 9.5 s, not 10 requests in 3 s (3.3 a second).
    clock = Clock()
    windows = VersionWindows(horizon_s=600, bucket_s=10, clock=clock)
    for i in range(20):
        clock.now = 1000.0 + i
        windows.observe("v1", _ended(0.1, 500, 100))
    clock.now = 1019.5
    assert windows.snapshot("v1", 3).covered_s == pytest.approx(9.5)
    load, _ = await WindowsLoadSource(windows).interval("v1", 3)
    assert load.request_rate == pytest.approx(10 / 9.5)
