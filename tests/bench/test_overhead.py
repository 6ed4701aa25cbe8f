"""bench.overhead: the fast fake engine speaks vLLM's wire shapes, Tandem's gateway streams
through both legs in front of it (started as users start it), and the figures are computed
right from given records and CPU readings."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from starlette.datastructures import Headers

from admission.plans import PriorityBand
from bench.harness.records import RequestRecord
from bench.harness.runner import execute
from bench.harness.summary import Slos, summarize
from bench.harness.workload import Api, Target, TenantSpec
from bench.overhead.cli import main
from bench.overhead.fake_vllm import FakeVllm, Timing
from bench.overhead.load import (
    LoadSpec,
    plan,
    run_level,
    size_of_measured_phase,
    staggered_offsets,
)
from bench.overhead.measure import (
    CpuWindow,
    LevelResult,
    Pooled,
    added_latency,
    core_busy,
    count_chunks,
    fit_cost,
    net_cpu_s,
    per_unit_ms,
)
from bench.overhead.procs import Server, start_fake_engine
from bench.overhead.profile import package_of, parse_collapsed
from bench.overhead.report import tracing_table
from bench.overhead.servers import TandemSetup, gateway_paths, start_tandem, tandem_env
from bench.overhead.trace_cost import (
    GATEWAY_SPANS_PER_REQUEST,
    SpanCount,
    TracingCost,
    TracingRunConfig,
    TracingRunError,
    check_spans,
    level_runs,
    run_tracing,
)
from bench.overhead.trace_off import a_request, cpu_us_per_request, one_request
from bench.overhead.vllm_wire import REQUIRED_REMOTE_KEYS
from core.errors import EngineError
from kv_transfer.handle import TransferHandle
from telemetry.request_trace import NO_TRACE
from telemetry.tracing import Tracing, TracingConfig
from workers.kv_usage import parse_kv_usage

MODEL = "fake-model"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "three words here"}]


# --- the fake engine, in this process (the ``fake`` fixture, tests/bench/conftest.py) ----------


async def events(url: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = (await response.read()).decode()
    blocks = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks)
    return [b[6:] if b == "data: [DONE]" else json.loads(b[6:]) for b in blocks]


async def test_chat_stream_has_vllms_chunk_shapes(fake: tuple[FakeVllm, str]) -> None:
    _, url = fake
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    out = await events(url + CHAT, {**body, "stream_options": {"include_usage": True}})
    role, *tokens, usage_chunk, done = out
    assert role["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
         "finish_reason": None}
    ]  # fmt: skip
    assert (role["prompt_token_ids"], role["prompt_text"]) == (None, None)
    assert "usage" not in role  # vLLM excludes unset fields
    assert [t["choices"][0]["delta"]["content"] for t in tokens] == [
        "alpha",
        " bravo",
        " charlie",
        " delta",
    ]
    assert [t["choices"][0]["finish_reason"] for t in tokens] == [None, None, None, "stop"]
    assert tokens[-1]["choices"][0]["stop_reason"] is None
    assert "stop_reason" not in tokens[0]["choices"][0]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 4, "total_tokens": 8, "completion_tokens": 4}
    assert usage_chunk["system_fingerprint"].startswith("vllm-0.32.0-")
    assert done == "[DONE]"
    ids = {chunk["id"] for chunk in out[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert {chunk["object"] for chunk in out[:-1]} == {"chat.completion.chunk"}

    # Without include_usage: no usage chunk, the fingerprint rides on the last token.
    plain = await events(url + CHAT, body)
    assert plain[-1] == "[DONE]" and plain[-2]["choices"][0]["finish_reason"] == "stop"
    assert "system_fingerprint" in plain[-2] and all("usage" not in c for c in plain[:-1])


async def test_max_tokens_and_continuous_usage(fake: tuple[FakeVllm, str]) -> None:
    _, url = fake
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 2}
    role, *tokens, usage_chunk, _ = await events(url + CHAT, {**body, "stream_options": options})
    assert len(tokens) == 2 and tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert role["usage"]["completion_tokens"] == 0
    assert [t["usage"]["completion_tokens"] for t in tokens] == [1, 2]
    assert tokens[0]["usage"]["completion_tokens_details"] is None
    assert usage_chunk["usage"]["completion_tokens"] == 2

    completions = await events(
        url + "/v1/completions",
        {"model": MODEL, "prompt": "a b c", "stream": True, "max_tokens": 3},
    )
    assert [c["choices"][0]["text"] for c in completions[:-1]] == ["alpha", " bravo", " charlie"]
    assert completions[0]["object"] == "text_completion"
    assert completions[-2]["choices"][0]["finish_reason"] == "length"


async def test_the_harness_accepts_the_fakes_streams(fake: tuple[FakeVllm, str]) -> None:
    engine, url = fake
    target = Target(base_url=url, model=MODEL, api=Api.CHAT)
    requests = plan(6, LoadSpec(prompt_words=5, num_tokens=3), TenantSpec("t"), warmup=False)
    records = await execute(target, requests, max_concurrency=3)
    assert [r.error_type for r in records] == [None] * 6
    assert all(r.completion_tokens == 3 and r.finish_reason == "length" for r in records)
    assert count_chunks(records) == 6 * 4  # role chunk + 3 tokens each
    assert engine.stats.running == 0 and engine.stats.streams == 6


async def test_a_level_paces_its_measured_requests(fake: tuple[FakeVllm, str]) -> None:
    _, url = fake
    target = Target(base_url=url, model=MODEL, api=Api.CHAT)
    spec = LoadSpec(prompt_words=5, num_tokens=3, min_requests=6, max_requests=6)
    paced = await run_level("direct", target, TenantSpec("t"), 3, spec, None, None)
    assert (paced.summary.sent, paced.summary.failed, paced.num_warmup) == (6, 0, 5)
    assert paced.summary.metrics["schedule_lag"] is not None  # requests had due times
    burst = await run_level(
        "direct", target, TenantSpec("t"), 3, dataclasses.replace(spec, stagger=False), None, None
    )
    assert burst.summary.metrics["schedule_lag"] is None  # a plain closed loop


async def test_prefill_leg_answers_a_usable_transfer_handle(fake: tuple[FakeVllm, str]) -> None:
    engine, url = fake
    leg1 = {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 1, "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }  # fmt: skip
    async with aiohttp.ClientSession() as session:
        async with session.post(url + CHAT, json=leg1) as response:
            answer = await response.json()
        handle = TransferHandle.from_prefill_response(
            answer, "fake", lease_s=10
        )  # the gateway's own check
        assert handle.engine_id == engine.engine_id and handle.num_blocks == 1
        assert all(answer["kv_transfer_params"][key] is not None for key in REQUIRED_REMOTE_KEYS)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 1

        leg2 = {**leg1, "max_tokens": 2, "kv_transfer_params": dict(handle.params)}
        async with session.post(url + CHAT, json=leg2) as response:
            assert response.status == 200
            assert (await response.json())["choices"][0]["message"]["content"] == "alpha bravo"
        broken = {**leg2, "kv_transfer_params": {"do_remote_prefill": True}}
        async with session.post(url + CHAT, json=broken) as response:
            assert response.status == 500
            assert (await response.json())["error"]["code"] == 500
    assert (engine.stats.prefill_legs, engine.stats.decode_legs) == (1, 2)
    assert engine.stats.kv_failures == 1
    with pytest.raises(EngineError):
        TransferHandle.from_prefill_response({"kv_transfer_params": None}, "fake", lease_s=10)


async def test_metrics_health_models_and_a_client_leaving(fake: tuple[FakeVllm, str]) -> None:
    engine, url = fake
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/health") as response:
            assert response.status == 200
        async with session.get(url + "/v1/models") as response:
            assert (await response.json())["data"][0]["id"] == MODEL
        async with session.get(url + "/metrics") as response:
            text = await response.text()
        body = {"model": MODEL, "messages": MESSAGES, "stream": True}
        async with session.post(url + CHAT, json=body) as response:
            await response.content.readline()
            assert engine.stats.running == 1
        async with session.post(url + CHAT, json={**body, "model": "other"}) as response:
            assert response.status == 404
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= names
    assert parse_kv_usage(text) == 0.0
    for _ in range(100):
        if engine.stats.aborted:
            break
        await asyncio.sleep(0.01)
    assert (engine.stats.aborted, engine.stats.running) == (1, 0)


# --- Tandem's gateway in front of the fakes, as processes --------------------------------------
@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Server, Server, Server, str]]:
    timing = Timing(num_tokens=3, itl_s=0.002)
    started: list[Server] = []
    try:
        for role in ("prefill", "decode"):
            started.append(start_fake_engine(f"fake-{role}", timing, MODEL, tmp_path, None))
        prefill, decode = started
        gateway, key = start_tandem(TandemSetup(), prefill.url, decode.url, MODEL, tmp_path, None)
        started.append(gateway)
        assert key is not None
        yield prefill, decode, gateway, key
    finally:
        for server in reversed(started):
            server.stop()


async def test_gateway_streams_through_both_legs(stack: tuple[Server, Server, Server, str]) -> None:
    prefill, decode, gateway, key = stack
    target = Target(base_url=gateway.url, model=MODEL, api=Api.CHAT)
    spec = LoadSpec(prompt_words=8, num_tokens=3, min_requests=4, max_requests=4)
    result = await run_level(
        "tandem-2leg", target, TenantSpec("t", api_key=key), 2, spec, gateway.cpu_times, None
    )
    assert (result.summary.sent, result.summary.failed) == (4, 0)
    # role + 3 tokens, the last split in two by the gateway (OpenAI's separate finish chunk)
    assert result.num_chunks == 4 * 5
    # The phase is too short for /proc's 10 ms CPU ticks; the process's total is not.
    assert result.cpu.server_s is not None and result.cpu.server_s >= 0
    assert gateway.cpu_seconds() > 0.1  # the gateway itself (imports, start-up), not a wrapper
    async with httpx.AsyncClient() as client:
        p_stats = (await client.get(prefill.url + "/_fake/stats")).json()
        d_stats = (await client.get(decode.url + "/_fake/stats")).json()
    assert p_stats["prefill_legs"] == 9 and p_stats["streams"] == 0  # 5 warm-up + 4
    assert d_stats["decode_legs"] == 9 and d_stats["prefill_legs"] == 0
    assert d_stats["kv_failures"] == 0
    leg2 = d_stats["last_bodies"][-1]
    assert leg2["kv_transfer_params"]["remote_block_ids"]
    assert leg2["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    paths = await asyncio.to_thread(gateway_paths, gateway.url)
    assert paths == {"disaggregated/long_prompt/finished": 9.0}


def test_cli_runs_direct_and_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = [
        "--targets", "direct", "--concurrency", "2", "--duration-s", "0.2", "--tokens", "3",
        "--itl-ms", "2", "--fit-concurrency", "0", "--no-fake-check", "--no-pin",
        "--out-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    figures = json.loads(out.read_text())
    (result,) = figures["results"]
    assert (result["target"], result["concurrency"]) == ("direct", 2)
    assert result["summary"]["failed"] == 0 and result["summary"]["sent"] >= 10
    assert result["chunks_per_request"] == 4  # role chunk + 3 tokens
    assert figures["engine_stats"]["fake-decode"]["streams"] == result["summary"]["sent"] + 5
    assert figures["config"]["timing"]["tokens"] == 3


def test_cli_runs_the_bare_relay_next_to_direct(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    argv = [
        "--targets", "direct,relay", "--concurrency", "2", "--duration-s", "0.2", "--tokens",
        "3", "--itl-ms", "2", "--fit-concurrency", "0", "--no-fake-check", "--no-pin",
        "--out-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = {r["target"]: r for r in json.loads(out.read_text())["results"]}
    relay = results["relay"]
    assert relay["summary"]["failed"] == 0 and relay["summary"]["sent"] >= 10
    # Every chunk of the engine's stream reaches the client, parsed and written again.
    assert relay["chunks_per_request"] == results["direct"]["chunks_per_request"] == 4
    assert relay["cpu_ms_per_request"] is not None  # the relay process was measured


def test_cli_runs_one_gateway_over_the_shared_stores_in_a_redis_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the run's work folder goes here
    out = tmp_path / "overhead.json"
    argv = [
        "--targets", "tandem-colocated,tandem-redis", "--concurrency", "2", "--duration-s",
        "0.3", "--tokens", "3", "--itl-ms", "2", "--fit-concurrency", "0", "--no-fake-check",
        "--no-pin", "--keep-work-dir", "--out-json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    results = {r["target"]: r for r in json.loads(out.read_text())["results"]}
    assert results["tandem-redis"]["summary"]["failed"] == 0
    assert results["tandem-redis"]["summary"]["sent"] >= 5
    # Its quotas were reserved in the Redis started for it (its append-only file has them),
    # and the in-memory target's tenants stayed in its own SQLite file.
    (work_dir,) = tmp_path.glob("tandem-overhead-*")
    written = b"".join(
        path.read_bytes() for path in (work_dir / "tandem-redis-store").rglob("*") if path.is_file()
    )
    assert b"tandem:quota:" in written
    assert (work_dir / "tandem-colocated" / "tandem.db").exists()
    assert not (work_dir / "tandem-redis" / "tandem.db").exists()


def test_cli_refuses_tracing_with_targets_of_its_own() -> None:
    assert main(["--tracing", "--targets", "direct"]) == 2
    assert main(["--tracing", "--rounds", "0"]) == 2


# --- tracing: the traced gateway, the calls tracing off makes, a whole run ---------------------
def test_only_the_traced_gateway_exports_spans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")  # this shell's
    endpoint = "http://127.0.0.1:4318/v1/traces"
    off, on = TandemSetup(), TandemSetup(tracing=True)
    assert (off.label, on.label) == ("tandem-2leg", "tandem-traced")
    assert TandemSetup(two_legs=False, tracing=True).label == "tandem-colocated-traced"
    # As the gateway's process gets them: this process's environment, then the setup's.
    env_off = {**os.environ, **tandem_env(off, MODEL, tmp_path)}
    env_on = {**os.environ, **tandem_env(on, MODEL, tmp_path, endpoint)}
    assert not TracingConfig.from_env(env_off).enabled
    assert TracingConfig.from_env(env_on) == TracingConfig(endpoint, sample_ratio=1.0)
    assert {k: v for k, v in env_on.items() if not k.startswith("OTEL_")} == {
        k: v for k, v in env_off.items() if not k.startswith("OTEL_")
    }
    with pytest.raises(ValueError, match="traces endpoint"):
        tandem_env(on, MODEL, tmp_path)
    with pytest.raises(ValueError, match="traces endpoint"):
        tandem_env(off, MODEL, tmp_path, endpoint)


async def test_the_timed_calls_are_the_gateways_and_cost_cpu() -> None:
    assert cpu_us_per_request(num_requests=2000, repeats=1) > 0
    band = PriorityBand.STANDARD
    off = Tracing(TracingConfig())
    assert off.start(Headers(), "chat") is NO_TRACE
    assert one_request(off, Headers(), a_request(), band) == (0, None)
    # Traced, the same calls build the gateway's tree (less tandem.kv_transfer, which the
    # request's timestamps make when it ends) and send a traceparent with each leg.
    exporter = InMemorySpanExporter()
    on = Tracing(TracingConfig(), exporter=exporter)
    sent, trace_id = one_request(on, Headers(), a_request(), band)
    await on.aclose()
    assert sent == 2 and trace_id is not None
    assert sorted(span.name for span in exporter.get_finished_spans()) == [
        "chat fake-model", "tandem.admission.queue", "tandem.authenticate", "tandem.billing",
        "tandem.decode", "tandem.moderation.input", "tandem.prefill",
    ]  # fmt: skip
    assert GATEWAY_SPANS_PER_REQUEST == 7 + 1  # those, and tandem.kv_transfer


def test_tracing_table_and_span_check() -> None:
    records = [record(i, 0.001, [0.02] * 9) for i in range(4)]  # 4 requests, 10 chunks each

    def rounds(*cpu_s: float) -> Pooled:
        return Pooled(tuple(level(cpu, records) for cpu in cpu_s))

    # 10 ms per request off; on: +9 % then +7 %, +8 % pooled. The calls off: 50 µs, 0.5 %.
    cost = TracingCost(1, rounds(0.040, 0.040), rounds(0.0436, 0.0428), off_path_us=50.0)
    assert cost.added_on == pytest.approx(0.08) and cost.on_holds
    assert cost.added_on_by_round == pytest.approx([0.09, 0.07])
    assert cost.added_off == pytest.approx(0.005) and cost.off_holds
    costly = TracingCost(1, rounds(0.040), rounds(0.048), off_path_us=200.0)
    assert (costly.on_holds, costly.off_holds) == (False, False)
    console = Console(record=True, width=240)
    console.print(tracing_table([cost, costly], {}))
    text = console.export_text()
    assert "rounds +7.00 %..+9.00 %" in text and "+8.00 %" in text and "+0.50 %" in text
    assert "+20.00 %" in text and "+2.00 %" in text and text.count("NO") == 2
    assert text.count("<= 10 %") == 2 and text.count("<= 1 %") == 2
    assert cost.to_dict()["off_path_us_per_request"] == 50.0

    check_spans(SpanCount(received=80, exports=2, traced_requests=10))
    with pytest.raises(TracingRunError, match="no span"):
        check_spans(SpanCount(received=0, exports=0, traced_requests=10))
    with pytest.raises(TracingRunError, match="dropped"):
        check_spans(SpanCount(received=70, exports=2, traced_requests=10))


def test_a_tracing_round_runs_every_level_and_the_fit() -> None:
    spec = LoadSpec(num_tokens=32)
    config = TracingRunConfig(levels=[16], spec=spec, timing=Timing(), fit_concurrency=64)
    assert [(c, s.num_tokens) for c, s in level_runs(config)] == [(16, 32), (64, 1), (64, 32)]
    config = dataclasses.replace(config, levels=[64])
    assert [(c, s.num_tokens) for c, s in level_runs(config)] == [(64, 32), (64, 1)]
    assert level_runs(dataclasses.replace(config, fit_concurrency=None)) == [(64, spec)]


async def test_a_tracing_run_counts_the_traced_gateways_spans() -> None:
    config = TracingRunConfig(
        levels=[2],
        spec=LoadSpec(prompt_words=8, num_tokens=3, min_requests=4, max_requests=4),
        timing=Timing(num_tokens=3, itl_s=0.002),
        rounds=1,
        fit_concurrency=None,
        pin=False,
        idle_s=0.1,
        off_path_requests=1000,
    )
    out = await run_tracing(config, Console(quiet=True))
    (cost,) = out.costs
    assert (cost.off.num_requests, cost.on.num_requests, cost.off.num_failed) == (4, 4, 0)
    assert out.spans is not None  # 5 warm-up requests and 4 measured, 8 spans each
    assert (out.spans.traced_requests, out.spans.received) == (9, 9 * GATEWAY_SPANS_PER_REQUEST)
    assert out.paths["tandem-traced"] == {"disaggregated/long_prompt/finished": 9.0}
    assert out.off_path_us > 0 and out.receiver_cpu_s is not None


# --- the figures ------------------------------------------------------------------------------
def record(index: int, ttft: float, gaps: list[float], *, warmup: bool = False) -> RequestRecord:
    r = RequestRecord(index, "t", warmup, None, max_tokens=8, expected_prompt_tokens=4)
    r.status, r.sent_s, r.ttft_s, r.itl_s = 200, 0.0, ttft, gaps
    r.e2e_s = r.elapsed_s = ttft + sum(gaps)
    r.prompt_tokens, r.completion_tokens, r.content_chunks = 4, len(gaps) + 1, len(gaps) + 1
    r.finish_reason = "length"
    return r


def level(
    cpu_s: float | None, records: list[RequestRecord], idle: float | None = None
) -> LevelResult:
    return LevelResult(
        target="x",
        concurrency=1,
        num_tokens=8,
        summary=summarize(records, Slos()),
        num_chunks=count_chunks(records),
        cpu=CpuWindow(server_s=cpu_s, engine_s=None, wall_s=2.0, core_busy={}),
        idle_cpu_ms_per_s=idle,
    )


def test_added_latency_is_a_difference_of_percentiles() -> None:
    direct = summarize([record(i, 0.001, [0.020, 0.020]) for i in range(3)], Slos())
    through = summarize([record(i, 0.004, [0.021, 0.021]) for i in range(3)], Slos())
    added = added_latency(through, direct)
    assert added.ttft_p50 == pytest.approx(3.0) and added.ttft_p99 == pytest.approx(3.0)
    assert added.itl_p50 == pytest.approx(1.0) and added.itl_p99 == pytest.approx(1.0)
    empty = summarize([], Slos())
    assert added_latency(through, empty).ttft_p50 is None


def test_cpu_per_request_and_chunk_net_of_idle() -> None:
    records = [record(i, 0.001, [0.02] * 9) for i in range(4)] + [
        record(9, 0.5, [0.02] * 9, warmup=True)  # warm-up: neither counted nor charged
    ]
    result = level(0.2, records)
    assert result.num_chunks == 40
    assert result.cpu_ms_per_request == pytest.approx(50.0)
    assert result.cpu_ms_per_chunk == pytest.approx(5.0)
    # 10 ms/s idle over the 2 s phase is 20 ms that no request caused.
    idle = level(0.2, records, idle=10.0)
    assert idle.cpu_ms_per_request == pytest.approx(45.0)
    assert idle.gross_cpu_ms_per_request == pytest.approx(50.0)
    assert net_cpu_s(0.01, 10.0, 2.0) == 0.0 and net_cpu_s(None, 1.0, 1.0) is None
    assert per_unit_ms(1.0, 0) is None and level(None, records).cpu_ms_per_chunk is None


def test_memory_per_open_stream_is_the_growth_over_idle_per_stream() -> None:
    records = [record(i, 0.001, [0.02]) for i in range(4)]
    base = level(0.1, records)
    grown = dataclasses.replace(
        base, concurrency=4, rss_idle_bytes=100 * 2**20, rss_peak_bytes=100 * 2**20 + 4 * 50 * 1024
    )
    assert grown.kb_per_stream == pytest.approx(50.0)
    shrunk = dataclasses.replace(grown, rss_peak_bytes=99 * 2**20)  # never negative
    assert shrunk.kb_per_stream == 0.0
    assert base.kb_per_stream is None  # not measured
    assert grown.to_dict()["kb_per_stream"] == pytest.approx(50.0)


def test_memory_per_added_stream_leaves_the_warm_up_out() -> None:
    records = [record(i, 0.001, [0.02]) for i in range(4)]
    idle = 100 * 2**20
    warm_up = 8 * 2**20  # grown once, by the first level
    low_peak = idle + warm_up + 64 * 40 * 1024
    low = dataclasses.replace(
        level(0.1, records), concurrency=64, rss_idle_bytes=idle, rss_peak_bytes=low_peak
    )
    high = dataclasses.replace(low, concurrency=512, rss_peak_bytes=low_peak + 448 * 40 * 1024)
    assert high.kb_per_added_stream(low) == pytest.approx(40.0)
    assert high.kb_per_stream == pytest.approx(40.0 + 8 * 1024 / 512)  # the upper bound: 56
    assert dataclasses.replace(low, rss_peak_bytes=None).kb_per_added_stream(low) is None
    with pytest.raises(ValueError, match="fewer streams"):
        low.kb_per_added_stream(high)


def test_fit_splits_cost_into_per_request_and_per_chunk() -> None:
    # 1 ms per request + 0.1 ms per chunk: 2 chunks -> 1.2 ms, 10 chunks -> 2.0 ms.
    short = level(4 * 1.2e-3, [record(i, 0.001, [0.02]) for i in range(4)])
    long = level(4 * 2.0e-3, [record(i, 0.001, [0.02] * 9) for i in range(4)])
    fit = fit_cost(short, long)
    assert fit is not None
    assert fit.ms_per_request == pytest.approx(1.0) and fit.ms_per_chunk == pytest.approx(0.1)
    assert fit.at(34) == pytest.approx(4.4)
    assert fit_cost(short, short) is None


def test_arrivals_are_paced_a_little_faster_than_the_slots_turn_over() -> None:
    # 4 slots of 1.1 s streams turn over every 0.275 s; arrivals come every 0.25 s.
    assert staggered_offsets(6, 4, 1.1) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.25])
    assert staggered_offsets(3, 1, 1.0) == [None] * 3  # one stream: a plain closed loop
    assert staggered_offsets(3, 4, 0.0) == [None] * 3


def test_core_busy_and_measured_phase_size() -> None:
    assert core_busy([(1.0, 10.0), (0.0, 10.0)], [(2.0, 12.0), (2.0, 12.0)]) == {0: 0.5, 1: 1.0}
    spec = LoadSpec(duration_s=10.0, min_requests=10, max_requests=1000)
    assert size_of_measured_phase(64, 1.0, 64, spec) == 640  # 64 req/s for 10 s
    assert size_of_measured_phase(5, 5.0, 1, spec) == 10  # floor: min_requests
    assert size_of_measured_phase(512, 1.0, 512, spec) == 1024  # floor: two rounds
    assert size_of_measured_phase(5000, 1.0, 64, spec) == 1000  # cap


def test_profile_aggregates_collapsed_stacks_by_function_and_package() -> None:
    root = "/repo/"
    site = "/venv/lib/python3.11/site-packages/"
    lines = [
        f"run (/usr/lib/python3.11/asyncio/runners.py:1);events (/repo/gateway/serving/relay.py:80);"
        f"loads ({site}orjson/__init__.py:3) 30",
        "run (/usr/lib/python3.11/asyncio/runners.py:1);events (/repo/gateway/serving/relay.py:90) 10",
        'process 7:"python -m gateway.cli up";run (/usr/lib/python3.11/asyncio/runners.py:1) 5',
        "not a stack line",
    ]
    profile = parse_collapsed(lines, root)
    assert profile.num_samples == 45
    # A sample whose leaf is the loop was in C code it called: uvloop's I/O, httptools.
    loop = next(name for name in profile.self_by_package if name.startswith("event loop"))
    assert profile.self_by_function[loop] == 5
    assert profile.self_by_function["loads (orjson/__init__.py)"] == 30
    assert profile.self_by_function["events (gateway/serving/relay.py)"] == 10
    assert (
        profile.total_by_function["events (gateway/serving/relay.py)"] == 40
    )  # both lines, once each
    assert profile.self_by_package == {"orjson": 30, "gateway": 10, loop: 5}
    assert profile.total_by_package["gateway"] == 40 and profile.total_by_package[loop] == 5
    assert "stdlib:asyncio" not in profile.total_by_package  # only the loop's root frames
    assert profile.top(profile.self_by_package, 1) == [("orjson", 30, 30 / 45)]
    assert package_of("/usr/lib/python3.11/asyncio/base_events.py", root) == "stdlib:asyncio"
    assert package_of("aiohttp/client.py", root) == "aiohttp"  # py-spy's short names
