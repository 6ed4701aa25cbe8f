from __future__ import annotations

import pytest

from bench.harness.records import RequestRecord
from bench.harness.summary import Slos, Stats, summarize, summarize_by_tenant


def record(
    index: int,
    *,
    tenant: str = "a",
    sent: float = 0.0,
    ttft: float = 0.1,
    gaps: tuple[float, ...] = (0.02, 0.02, 0.02),
    tokens: int = 4,
    prompt: int = 10,
    status: int = 200,
    error_type: str | None = None,
    warmup: bool = False,
    queue_ms: float | None = None,
) -> RequestRecord:
    r = RequestRecord(index, tenant, warmup, None, max_tokens=16, expected_prompt_tokens=prompt)
    r.sent_s, r.status, r.error_type = sent, status, error_type
    r.elapsed_s = 0.01
    if status == 200 and error_type is None:
        r.ttft_s, r.itl_s = ttft, list(gaps)
        r.e2e_s = r.elapsed_s = ttft + sum(gaps)
        r.prompt_tokens, r.completion_tokens = prompt, tokens
    r.queue_ms = queue_ms
    return r


def test_stats_percentiles_match_numpy_linear_interpolation() -> None:
    stats = Stats.of([1.0, 2.0, 3.0, 4.0])
    assert stats is not None
    assert (stats.n, stats.mean, stats.p50, stats.min, stats.max) == (4, 2.5, 2.5, 1.0, 4.0)
    assert stats.p90 == pytest.approx(3.7)
    assert Stats.of([]) is None


def test_tpot_excludes_the_first_token_and_uses_server_usage() -> None:
    r = record(0, ttft=0.1, gaps=(0.03, 0.03, 0.03), tokens=4)
    assert r.tpot_s == pytest.approx(0.03)
    assert r.ntpot_s == pytest.approx(0.19 / 4)
    assert record(1, tokens=1, gaps=()).tpot_s is None


def test_summary_figures_exclude_warmup_and_count_failures() -> None:
    records = [
        record(0, warmup=True, ttft=9.0),
        record(1, sent=0.0, ttft=0.1),
        record(2, sent=1.0, ttft=0.3),
        record(3, sent=1.5, status=429, error_type="rate_limit_exceeded"),
        record(4, sent=1.6, error_type="malformed"),
    ]
    s = summarize(records, Slos())
    assert (s.sent, s.completed, s.failed, s.malformed) == (4, 2, 2, 1)
    assert s.metrics["ttft"] is not None and s.metrics["ttft"].max == pytest.approx(300)
    assert s.metrics["itl"] is not None and s.metrics["itl"].n == 6
    assert s.duration_s == pytest.approx(1.61)  # run start to the last answer, errors too
    # vLLM's duration: an open loop's wait for its first arrival counts.
    assert summarize([record(0, sent=0.5, ttft=0.1, gaps=())], Slos()).duration_s == 0.6
    assert s.total_output_tokens == 8 and s.total_input_tokens == 20
    assert s.request_throughput == pytest.approx(2 / 1.61)
    assert s.errors_by_status == {"429": 1, "200": 1}
    assert s.errors_by_type == {"rate_limit_exceeded": 1, "malformed": 1}
    assert s.good == 2 and s.slo_attainment == 0.5  # no SLO: every completed request is good


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [
        record(0, ttft=0.1, gaps=(0.02, 0.02)),
        record(1, ttft=0.6, gaps=(0.02, 0.02)),  # TTFT too slow
        record(2, ttft=0.1, gaps=(0.02, 0.2)),  # one long stall
        record(3, ttft=0.1, gaps=(0.02, 0.02)),
    ]
    slos = Slos.parse(["ttft:500", "itl:100"])
    s = summarize(records, slos)
    assert s.good == 2 and s.slo_attainment == 0.5
    assert s.goodput == pytest.approx(2 / s.duration_s)
    assert summarize(records, Slos.parse(["e2el:200"])).good == 2  # vLLM's name accepted


@pytest.mark.parametrize("spec", ["ttft", "ttft:-1", "latency:5", "itl:abc"])
def test_bad_slo_specs_name_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
        Slos.parse([spec])


def test_per_tenant_summaries_share_the_run_duration() -> None:
    records = [record(0, tenant="a"), record(1, tenant="b", sent=1.0), record(2, tenant="b")]
    overall = summarize(records, Slos())
    tenants = summarize_by_tenant(records, Slos(), overall.duration_s)
    assert set(tenants) == {"a", "b"}
    assert tenants["b"].completed == 2
    total = sum(t.request_throughput for t in tenants.values())
    assert total == pytest.approx(overall.request_throughput)


def test_queue_wait_is_reported_when_the_gateway_sends_it() -> None:
    s = summarize([record(0, queue_ms=12.0), record(1, queue_ms=4.0), record(2)], Slos())
    assert s.metrics["queue"] is not None and s.metrics["queue"].n == 2
    assert summarize([record(0)], Slos()).metrics["queue"] is None
