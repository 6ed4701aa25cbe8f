"""Issue 19's flood on the real stack: two tenants with weights 1 and 3 keep 24 streams each open
against one decode worker capped at 8 in flight, while a light interactive tenant sends one short
chat request a second (``bench.noisy_neighbours``, shorter phases).

Asserted: the weight-3 tenant is served 3 times the weight-1 tenant's tokens (within 10%, plus
the gap VTC allows in any window) over a steady-state window, no request of anyone
ends in a 5xx or any error, and the ledger holds exactly one row per request a heavy client saw,
with the tokens it saw. The light tenant's TTFT,
unloaded and flooded, is printed with the profile (speed is the bench's to report, not a test's
to assert: docs/ARCHITECTURE.md says what bounds it on this machine).

The load generator runs in a fresh process. In this test session's process it shares the whole
suite's heap and the OTLP receiver's thread, and once in CI that process stalled through most of
the window: the gateway saw 11 of the light phase's 40 requests (the phase sends one after each
1 s sleep), its span exports to the receiver timed out twice, and the ratio came out 1.32 with
both tenants at 4 in flight (a stalled client stops sending, and the weight-3 tenant's shorter
queue runs dry first). The next CI run showed it was not that process's: the fresh one stalled
22.8 s too. So a window in which the generator stalls 2 s or more is discarded and another is
measured (three in all), each printed with what the host did meanwhile (CPU steal, iowait, the
kernel's pressure stalls, the generator's own wait for a CPU). The measured window's stalls are
asserted against before the ratio, so a failure says which of the two it was.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from bench.noisy_neighbours import FloodResult, print_result, run_flood
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
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as generator:
        result: FloodResult = generator.submit(
            run_flood, live_stack.base_url, ADMIN_KEY, live_stack.model,
            light_band="interactive", duration_s=40, warmup_s=20,
        ).result()  # fmt: skip
    with capsys.disabled():
        print("\nissue 19 flood on the real stack (e2e settings: eager workers):")
        print_result(result, "interactive")

    # The weight-3 tenant's ~18 queued requests last it ~16 s of admissions: a stall of 2 s
    # cannot empty its queue, and the window's premise (both tenants backlogged) holds.
    window = result.measured
    assert window.longest_stall_s < 2.0, (
        f"the load generator stalled for 2 s or more in each of {len(result.windows)} windows "
        f"(last: {window.longest_stall_s:.1f} s, {window.stalled_s:.1f} s in all): its tenants "
        "were not kept backlogged, so no window says anything of fairness; the host in each: "
        + "; ".join(each.host for each in result.windows)
    )

    # VTC keeps two backlogged tenants' weighted service within a constant of each other over
    # any window: twice the largest charge of one request (prompt + 2 x output). A 40 s window
    # holds only ~9 requests' worth of w1's service, so that constant is ~20 % of it: asserted
    # is 10 % of the weights plus that bound (seen: 2.91-3.04 in 60 s bench windows, 3.30 and
    # 3.68 in this test). A tenant served without its weight misses it by ~1,000 tokens.
    w1, w3 = result.served["w1"], result.served["w3"]
    one_request = max(s.served_in(float("-inf"), float("inf")) for s in result.heavy["w1"].streams)
    assert abs(w3 / 3 - w1) <= 0.1 * w1 + 2 * one_request, (
        f"weight-3 : weight-1 served tokens {result.ratio:.2f} ({w3:.0f} : {w1:.0f} in a "
        f"{window.seconds:.1f} s window; one request is {one_request:.0f}); "
        f"profile: {window.profile}"
    )
    for name, load in result.heavy.items():
        assert not load.errors, f"heavy {name} saw errors: {load.errors}"
    assert not result.unloaded.errors  # and none in any window, the discarded ones' too
    assert not [each.flooded.errors for each in result.windows if each.flooded.errors]
    assert result.unloaded.ttfts_s and window.flooded.ttfts_s

    ledger = _ledger(live_stack)
    for name, load in result.heavy.items():
        for stream in load.streams:
            assert stream.response_id is not None and stream.completion_tokens is not None
            row = ledger[stream.response_id.removeprefix("chatcmpl-")]
            assert int(row["prompt_tokens"]) == stream.prompt_tokens, (name, row)
            assert int(row["completion_tokens"]) == stream.completion_tokens, (name, row)
