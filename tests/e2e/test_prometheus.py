"""A real Prometheus (Debian's package) scrapes the running stack, the gateway and both vLLM
workers, and answers PromQL over what they export: the GenAI series per version, the workers'
own series, and a traced request's trace id as the exemplar of its latency buckets."""

from __future__ import annotations

import secrets
import time
from urllib.parse import urlsplit

import pytest

from tests.e2e.conftest import LiveStack, traced_stream
from tests.prometheus_server import running_prometheus

pytestmark = pytest.mark.e2e


def _target(url: str) -> str:
    return urlsplit(url).netloc


def test_prometheus_scrapes_the_stack_and_finds_a_request_by_its_trace(
    live_stack: LiveStack,
) -> None:
    targets = [_target(u) for u in (live_stack.base_url, live_stack.prefill_url,
                                    live_stack.decode_url)]  # fmt: skip
    with running_prometheus(targets, 1.0, ["--enable-feature=exemplar-storage"]) as prometheus:
        prometheus.wait_for("up == 1", lambda result: len(result) == 3)
        started = time.time()
        trace_id = secrets.token_hex(16)
        assert traced_stream(live_stack, trace_id, secrets.token_hex(8))

        version = f'tandem_version="{live_stack.version}"'
        prometheus.wait_for(
            f"sum(gen_ai_server_request_duration_seconds_count{{{version},"
            f'tandem_path="disaggregated",tandem_outcome="finished"}})',
            lambda result: bool(result) and float(result[0]["value"][1]) >= 1,
        )
        p50 = prometheus.query(
            "histogram_quantile(0.5, sum by (le) (gen_ai_server_time_to_first_token_seconds_"
            f"bucket{{{version}}}))"
        )
        assert 0 < float(p50[0]["value"][1]) < 10
        output = prometheus.query(
            f'sum(gen_ai_server_token_usage_sum{{{version},gen_ai_token_type="output"}})'
        )
        assert float(output[0]["value"][1]) >= 8
        # The workers' own series, scraped from the workers themselves.
        workers = prometheus.query("vllm:num_requests_running")
        assert {_target(f"http://{r['metric']['instance']}") for r in workers} >= set(targets[1:])

        exemplars: list[dict[str, object]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            exemplars = prometheus.query_exemplars(
                f"gen_ai_server_time_to_first_token_seconds_bucket{{{version}}}",
                started - 60,
                time.time() + 60,
            )
            found = [e for series in exemplars for e in series["exemplars"]]  # type: ignore[attr-defined]
            if any(e["labels"].get("trace_id") == trace_id for e in found):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no exemplar with trace id {trace_id}: {exemplars}")
