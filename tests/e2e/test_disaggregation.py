"""The prompt really is prefilled on the prefill worker and its KV really reaches the decode
worker over NIXL: read from the workers' own counters, not from anything the gateway says."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import openai
import psutil
import pytest

from bench.kv_transfer.transfer import idle_cores
from tests.e2e.conftest import LiveStack

pytestmark = pytest.mark.e2e

_BY_SOURCE = re.compile(r"^vllm:prompt_tokens_by_source_total\{([^}]*)\}\s+([0-9.e+-]+)$", re.M)


def prompt_tokens_by_source(worker_url: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source`` per source: local_compute, local_cache_hit,
    external_kv_transfer (tokens whose KV came from another vLLM instance)."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for labels, value in _BY_SOURCE.findall(text):
        source = re.search(r'source="([^"]+)"', labels)
        assert source is not None
        totals[source.group(1)] = totals.get(source.group(1), 0.0) + float(value)
    assert totals, f"{worker_url}/metrics has no vllm:prompt_tokens_by_source"
    return totals


def test_decode_worker_receives_kv_instead_of_recomputing(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    # A prompt no worker has seen, so no prefix cache can explain the numbers.
    # Long enough to pass the decider's default threshold (256 estimated tokens), short enough
    # for the test stack's 1024-token context; the leading id defeats every prefix cache.
    words = uuid.uuid4().hex + " " + "the quick brown fox jumps over the lazy dog " * 40
    before_decode = prompt_tokens_by_source(live_stack.decode_url)
    before_prefill = prompt_tokens_by_source(live_stack.prefill_url)

    completion = client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": f"Repeat these words: {words}"}],
        max_tokens=8,
        temperature=0,
    )
    assert completion.usage is not None
    prompt_tokens = completion.usage.prompt_tokens
    assert prompt_tokens > 200

    decode = _delta(before_decode, prompt_tokens_by_source(live_stack.decode_url))
    prefill = _delta(before_prefill, prompt_tokens_by_source(live_stack.prefill_url))
    # The prefill worker computed the prompt...
    assert prefill.get("local_compute", 0) >= prompt_tokens * 0.9, prefill
    # ...and the decode worker received nearly all of it over NIXL (vLLM recomputes at most the
    # last partial block locally); a recomputing decode worker would show it as local_compute.
    assert decode.get("external_kv_transfer", 0) >= prompt_tokens * 0.8, decode
    assert decode.get("local_compute", 0) <= prompt_tokens * 0.2, decode


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {source: after[source] - before.get(source, 0.0) for source in after}


def test_decider_short_prompt_colocated_long_prompt_split(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    def count(path: str, reason: str) -> float:
        text = httpx.get(f"{live_stack.base_url}/metrics", timeout=10).text
        pattern = (
            rf'^tandem_requests_total\{{model="[^"]+",outcome="finished",path="{path}",'
            rf'reason="{reason}",version="[^"]+"\}}\s+([0-9.]+)$'
        )
        return sum(float(found) for found in re.findall(pattern, text, re.M))  # all versions

    short_before = count("colocated", "short_prompt")
    long_before = count("disaggregated", "long_prompt")
    prefill_before = prompt_tokens_by_source(live_stack.prefill_url).get("local_compute", 0.0)
    client.chat.completions.create(
        model=live_stack.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert count("colocated", "short_prompt") == short_before + 1
    # The prefill worker never saw the short prompt.
    assert prompt_tokens_by_source(live_stack.prefill_url).get("local_compute") == prefill_before
    long_prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 40
    client.chat.completions.create(
        model=live_stack.model, messages=[{"role": "user", "content": long_prompt}], max_tokens=2
    )
    assert count("disaggregated", "long_prompt") == long_before + 1


def test_gateway_reexports_the_workers_transfer_and_cache_counters(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": uuid.uuid4().hex + " " + "lorem ipsum " * 150}],
        max_tokens=2,
    )
    text = httpx.get(f"{live_stack.base_url}/metrics", timeout=10).text
    transfers = re.search(
        r'^tandem_worker_kv_transfers_total\{worker="decode-0",role="decode"\} ([0-9.e+]+)$',
        text,
        re.M,
    )
    assert transfers and float(transfers.group(1)) >= 1, text[-2000:]
    queries = re.search(
        r'^tandem_worker_prefix_cache_queries_total\{worker="prefill-0",role="prefill"\} ([0-9.e+]+)$',
        text,
        re.M,
    )
    assert queries and float(queries.group(1)) > 0


def _sample_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.e+-]+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


def test_the_gateway_counts_the_kv_bytes_the_decode_worker_read(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    """Per request, the gateway prices the transfer handle (its blocks x the model's bytes per
    block); vLLM counts only per worker. For a prompt nobody has seen the two must agree."""
    words = uuid.uuid4().hex + " " + "a stitch in time saves nine, said the tailor " * 40
    gateway_before = _sample_sum(live_stack.base_url, "tandem_kv_handoff_bytes_sum")
    engine_before = _sample_sum(live_stack.decode_url, "vllm:nixl_bytes_transferred_sum")

    client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": f"Repeat these words: {words}"}],
        max_tokens=4,
    )

    gateway_bytes = _sample_sum(live_stack.base_url, "tandem_kv_handoff_bytes_sum") - gateway_before
    # vLLM publishes connector stats on its logging interval, not when the transfer ends.
    deadline = time.monotonic() + 15
    engine_bytes = 0.0
    while time.monotonic() < deadline and engine_bytes < gateway_bytes:
        time.sleep(0.5)
        engine_bytes = (
            _sample_sum(live_stack.decode_url, "vllm:nixl_bytes_transferred_sum") - engine_before
        )
    assert gateway_bytes > 0
    assert engine_bytes == gateway_bytes


def test_idle_workers_leave_the_cores_alone(live_stack: LiveStack) -> None:
    """NIXL's progress thread busy-polls one core per worker unless Tandem's vLLM plugin gives
    it a poll timeout (kv_transfer/nixl_progress.py)."""
    assert live_stack.log_dir is not None
    for role in ("prefill", "decode"):
        log = (live_stack.log_dir / f"{role}-0.log").read_text(errors="replace")
        assert "progress thread polls every 1000 us" in log, f"plugin not loaded on {role}-0"
    workers = psutil.Process(live_stack.pid).children(recursive=True)
    cores = idle_cores(workers, 3.0)
    # Spinning, two idle workers use two whole cores; polling every millisecond, a few percent.
    assert cores < 0.5, f"idle workers used {cores:.2f} cores"
