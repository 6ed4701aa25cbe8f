"""Issue 19's flood on the real stack: two tenants with weights 1 and 3 keep 24 streams each open
against one decode worker capped at 8 in flight, while a light interactive tenant sends one short
chat request a second (``bench.noisy_neighbours``, shorter phases).

Asserted: the weight-3 tenant is served 3 times the weight-1 tenant's tokens (within 10%, plus
the gap VTC allows in any window) over a steady-state window, no request of anyone
ends in a 5xx or any error, and the ledger holds exactly one row per request a heavy client saw,
with the tokens it saw. The light tenant's TTFT,
unloaded and flooded, is printed with the profile (speed is the bench's to report, not a test's
to assert: docs/ARCHITECTURE.md says what bounds it on this machine).
"""

from __future__ import annotations

import asyncio

import pytest

from bench.noisy_neighbours import FloodResult, flood, print_result
from tests.e2e.conftest import ADMIN_KEY, LiveStack, ledger_rows

pytestmark = pytest.mark.e2e


def _ledger(live_stack: LiveStack) -> dict[str, dict[str, str]]:
    """Every billed request of the session, by request id."""
    rows = ledger_rows(live_stack)
    by_id = {row["request_id"]: row for row in rows}
    assert len(by_id) == len(rows), "a request id billed twice"
    return by_id


def test_weighted_share_and_isolation_under_a_flood(
    live_stack: LiveStack, capsys: pytest.CaptureFixture[str]
) -> None:
    result: FloodResult = asyncio.run(
        flood(live_stack.base_url, ADMIN_KEY, live_stack.model, light_band="interactive",
              duration_s=40, warmup_s=20)
    )  # fmt: skip
    with capsys.disabled():
        print("\nissue 19 flood on the real stack (e2e settings: eager workers):")
        print_result(result, "interactive")

    # VTC keeps two backlogged tenants' weighted service within a constant of each other over
    # any window: twice the largest charge of one request (prompt + 2 x output). A 40 s window
    # holds only ~9 requests' worth of w1's service, so that constant is ~20 % of it: asserted
    # is 10 % of the weights plus that bound (seen: 2.91-3.04 in 60 s bench windows, 3.30 and
    # 3.68 in this test). A tenant served without its weight misses it by ~1,000 tokens.
    w1, w3 = result.served["w1"], result.served["w3"]
    one_request = max(s.served_in(float("-inf"), float("inf")) for s in result.heavy["w1"].streams)
    assert abs(w3 / 3 - w1) <= 0.1 * w1 + 2 * one_request, (
        f"weight-3 : weight-1 served tokens {result.ratio:.2f} ({w3:.0f} : {w1:.0f} in a "
        f"{result.window_s:.1f} s window; one request is {one_request:.0f}); "
        f"profile: {result.profile}"
    )
    for name, load in result.heavy.items():
        assert not load.errors, f"heavy {name} saw errors: {load.errors}"
    assert not result.unloaded.errors and not result.flooded.errors
    assert result.unloaded.ttfts_s and result.flooded.ttfts_s

    ledger = _ledger(live_stack)
    for name, load in result.heavy.items():
        for stream in load.streams:
            assert stream.response_id is not None and stream.completion_tokens is not None
            row = ledger[stream.response_id.removeprefix("chatcmpl-")]
            assert int(row["prompt_tokens"]) == stream.prompt_tokens, (name, row)
            assert int(row["completion_tokens"]) == stream.completion_tokens, (name, row)
