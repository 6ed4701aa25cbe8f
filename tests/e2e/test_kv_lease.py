"""KV a prefill worker holds for a decode leg that never comes is freed by the lease, promptly.

This is the client-gone-between-the-legs case: leg 1 is sent exactly as the gateway sends it,
and no leg 2 follows.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from kv_transfer.connector import ConnectorConfig
from kv_transfer.legs import prefill_leg_body
from tests.e2e.conftest import LiveStack, worker_gauge

pytestmark = pytest.mark.e2e


def kv_cache_usage(worker_url: str) -> float:
    return worker_gauge(worker_url, "vllm:kv_cache_usage_perc")


def test_abandoned_prefill_kv_returns_to_baseline(live_stack: LiveStack) -> None:
    baseline = kv_cache_usage(live_stack.prefill_url)
    words = uuid.uuid4().hex + " " + "the quick brown fox jumps over the lazy dog " * 40
    body = prefill_leg_body(
        {
            "model": live_stack.version,  # the name the workers serve
            "messages": [{"role": "user", "content": f"Repeat: {words}"}],
            "max_tokens": 8,
        }
    )
    response = httpx.post(
        f"{live_stack.prefill_url}/v1/chat/completions",
        json=body,
        headers={"X-Request-Id": uuid.uuid4().hex},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.json()["kv_transfer_params"]["remote_block_ids"]
    # vLLM refreshes the gauge with its scheduler's stats, not at the response: read until it
    # shows the held blocks (a single read right after the response failed once under load).
    held_by = time.monotonic() + 5
    while kv_cache_usage(live_stack.prefill_url) <= baseline:
        assert time.monotonic() < held_by, "the prefill worker keeps the KV for a decode leg"
        time.sleep(0.2)

    lease_s = ConnectorConfig().kv_lease_s
    deadline = time.monotonic() + lease_s + 20
    while kv_cache_usage(live_stack.prefill_url) > baseline:
        assert time.monotonic() < deadline, f"KV still held {lease_s + 20} s after leg 1"
        time.sleep(0.5)
