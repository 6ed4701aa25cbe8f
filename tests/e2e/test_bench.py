"""``tandem bench`` on the real stack, run as users run it (the console script): through the
gateway with two tenants, and directly against the decode worker where the server's own token
counts must equal the dataset's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.result import RunResult
from tests.e2e.conftest import LiveStack

pytestmark = pytest.mark.e2e
TANDEM = str(Path(sys.executable).parent / "tandem")


def tandem_bench(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TANDEM, "bench", *map(str, args), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_two_tenants_through_the_gateway(live_stack: LiveStack, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            [
                {"name": "bench-a", "share": 1, "api_key": live_stack.new_tenant("bench-a")},
                {"name": "bench-b", "share": 1, "api_key": live_stack.new_tenant("bench-b"),
                 "output_len": "fixed:8"},
            ]
        )
    )  # fmt: skip
    done = tandem_bench(
        "run", "--base-url", live_stack.base_url, "--tenants", tenants, "--concurrency", "2",
        "--num-requests", "8", "--warmup", "1", "--input-len", "lognormal:64:0.4",
        "--output-len", "fixed:16", "--slo", "ttft:30000", "--out-json", tmp_path / "run.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "latency (ms)" in done.stdout
    result = RunResult.load_json(tmp_path / "run.json")
    s = result.summary
    # Every stream passed the checks (SSE, [DONE], finish_reason, usage vs the re-tokenised text).
    assert (s.completed, s.failed) == (8, 0), s.errors_by_type
    assert set(result.tenants) == {"bench-a", "bench-b"}
    assert s.metrics["queue"] is not None  # the gateway's x-tandem-queue-ms
    measured = [r for r in result.records if not r.warmup]
    # The chat template adds tokens to what the dataset counted.
    assert all((r.prompt_tokens or 0) > r.expected_prompt_tokens for r in measured)
    assert all(r.max_tokens == 8 for r in measured if r.tenant == "bench-b")


def test_direct_to_vllm_the_server_counts_what_the_dataset_made(
    live_stack: LiveStack, tmp_path: Path
) -> None:
    done = tandem_bench(
        "run", "--base-url", live_stack.decode_url, "--api", "completions", "--ignore-eos",
        "--rate", "4", "--max-concurrency", "2", "--num-requests", "6",
        "--input-len", "uniform:20:120", "--output-len", "uniform:4:12",
        "--out-json", tmp_path / "direct.json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = RunResult.load_json(tmp_path / "direct.json").records
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records]
    for r in records:
        assert r.prompt_tokens == r.expected_prompt_tokens  # exact lengths, no template
        assert r.completion_tokens == r.max_tokens  # ignore_eos
        assert len(r.itl_s) == r.completion_tokens - 1  # one chunk per token, vLLM's ITL
