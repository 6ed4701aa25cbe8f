"""The fake vLLM engine speaks vLLM 0.32's wire shapes, both P/D legs, and injects faults."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.fake_engine import FakeEngine, count_prompt_tokens

ROOT = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]  # 7 fake tokens
LEG1_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine("m") as e:
        yield e


async def post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with s.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


async def sse(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """All `data:` payloads of a stream, JSON-decoded except the final [DONE] marker."""
    async with s.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


async def test_health_models_and_prompt_count(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    async with session.get(engine.base_url + "/health") as r:
        assert r.status == 200
        assert await r.read() == b""
    async with session.get(engine.base_url + "/v1/models") as r:
        card = (await r.json())["data"][0]
    assert card["id"] == "m"
    assert card["owned_by"] == "vllm"
    assert card["max_model_len"] == 2048
    assert count_prompt_tokens(CHAT, {"messages": MSGS}) == 7
    engine.healthy = False
    async with session.get(engine.base_url + "/health") as r:
        assert r.status == 503


async def test_non_streaming_chat_shape(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    status, body = await post(session, engine.base_url + CHAT, {"model": "m", "messages": MSGS})
    assert status == 200
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None
    assert len(choice["message"]["content"].split()) == engine.output_tokens
    # natural stop: 8 words + the EOS token, which vLLM counts
    assert body["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 16,
        "completion_tokens": 9,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert body["kv_transfer_params"] is None
    again = await post(session, engine.base_url + CHAT, {"messages": MSGS})
    assert again[1]["choices"][0]["message"] == choice["message"]  # deterministic
    status, capped = await post(
        session, engine.base_url + CHAT, {"messages": MSGS, "max_tokens": 3}
    )
    assert capped["choices"][0]["finish_reason"] == "length"
    assert capped["usage"]["completion_tokens"] == 3
    assert engine.stats.num_requests == 3
    assert engine.stats.num_local_prefills == 3


async def test_stream_without_usage(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    events = await sse(session, engine.base_url + CHAT, {"messages": MSGS, "max_tokens": 4})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("usage" not in c for c in chunks)  # vLLM omits the key, it is not null
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None] * 3 + ["length"]
    assert chunks[-1]["choices"][0]["delta"]["content"]  # last token rides on the final chunk
    assert chunks[-1]["system_fingerprint"].startswith("vllm-0.32.0-")


async def test_stream_with_usage_and_n(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    body = {"messages": MSGS, "n": 2, "stream_options": {"include_usage": True}}
    events = await sse(session, engine.base_url + CHAT, body)
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 7, "total_tokens": 25, "completion_tokens": 18}
    token_chunks = events[:-2]
    assert all("usage" not in c and "system_fingerprint" not in c for c in token_chunks)
    finishes = [c["choices"][0] for c in token_chunks if c["choices"][0]["finish_reason"]]
    assert sorted(ch["index"] for ch in finishes) == [0, 1]


async def test_completions_stream_and_stop(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    url = engine.base_url + "/v1/completions"
    events = await sse(url=url, s=session, body={"prompt": "a b c", "max_tokens": 2})
    assert [e["object"] for e in events[:-1]] == ["text_completion"] * 2
    assert events[0]["choices"][0]["text"]
    assert "delta" not in events[0]["choices"][0]
    status, full = await post(session, url, {"prompt": "a b c", "max_tokens": 5})
    words = full["choices"][0]["text"].split()
    status, stopped = await post(session, url, {"prompt": "a b c", "stop": [words[2]]})
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == words[2]
    assert choice["text"].split() == words[:2]
    status, default = await post(session, url, {"prompt": "a b c"})
    assert default["usage"]["prompt_tokens"] == 3
    assert status == 200


async def test_validation_errors(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    url = engine.base_url
    status, body = await post(session, url + CHAT, {"model": "m"})
    assert status == 400
    assert body["error"]["type"] == "Bad Request"
    assert body["error"]["param"] == "body.messages"
    assert body["error"]["code"] == 400
    assert "'missing'" in body["error"]["message"]
    status, body = await post(session, url + "/v1/completions", {"model": "m"})
    assert status == 400
    assert body["error"]["param"] == "prompt"
    status, body = await post(session, url + CHAT, {"model": "other", "messages": MSGS})
    assert status == 404
    assert body == {
        "error": {
            "message": "The model `other` does not exist. Valid aliases: m.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    leg1_with_stream_opts = {"messages": MSGS, "stream_options": {"include_usage": True}}
    status, body = await post(session, url + CHAT, leg1_with_stream_opts)
    assert status == 400
    assert body["error"]["param"] == "stream_options"
    assert engine.stats.num_requests == 0


async def test_context_length_errors(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    engine.max_model_len = 5
    status, body = await post(session, engine.base_url + CHAT, {"messages": MSGS})
    assert status == 400
    assert body["error"] == {
        "message": "This model's maximum context length is 5 tokens. However, your prompt "
        "contains 7 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=7)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
    engine.max_model_len = 10
    status, body = await post(session, engine.base_url + CHAT, {"messages": MSGS, "max_tokens": 20})
    assert status == 400
    assert body["error"]["param"] == "max_tokens"
    status, body = await post(session, engine.base_url + CHAT, {"messages": MSGS})
    assert body["choices"][0]["finish_reason"] == "length"  # clamped to 10 - 7 tokens
    assert body["usage"]["completion_tokens"] == 3


async def test_two_legs(session: aiohttp.ClientSession) -> None:
    async with FakeEngine("m", role="prefill") as p, FakeEngine("m", role="decode") as d:
        leg1 = {"messages": MSGS, "max_tokens": 1, "kv_transfer_params": LEG1_PARAMS}
        status, r1 = await post(session, p.base_url + CHAT, leg1)
        assert status == 200
        assert r1["choices"][0]["finish_reason"] == "length"
        kvp = r1["kv_transfer_params"]
        assert kvp["do_remote_prefill"] is True
        assert kvp["do_remote_decode"] is False
        assert kvp["remote_engine_id"] == p.engine_id
        assert kvp["remote_block_ids"] == [[1]]
        assert kvp["remote_request_id"].startswith(r1["id"] + "-")
        assert kvp["tp_size"] == 1
        assert {"remote_host", "remote_port", "remote_num_tokens"} <= kvp.keys()
        assert len(p.kv_store) == 1
        assert p.stats.num_kv_produced == 1
        leg2 = {"messages": MSGS, "kv_transfer_params": kvp, "stream_options": {}}
        events = await sse(session, d.base_url + CHAT, leg2)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        assert d.stats.num_remote_prefills == 1
        assert d.stats.num_local_prefills == 0
        assert p.kv_store == {}  # decode read it, prefill freed it
        async with session.get(d.base_url + "/metrics") as r:
            metrics = await r.text()
        assert 'source="external_kv_transfer"} 7.0' in metrics
        assert 'source="local_compute"} 0.0' in metrics
        assert 'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="m"} 1.0' in metrics
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                     "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
                     "vllm:nixl_num_failed_transfers_total"):  # fmt: skip
            assert f"\n{name}{{" in metrics
        # the KV was consumed: replaying leg 2 is a KV load failure -> vLLM's 500
        status, body = await post(session, d.base_url + CHAT, leg2)
        assert status == 500
        assert body["error"]["type"] == "InternalServerError"
        assert body["error"]["code"] == 500
        assert d.stats.num_kv_load_failures == 1


async def test_leg2_after_prefill_died(session: aiohttp.ClientSession) -> None:
    async with FakeEngine("m", role="decode") as d:
        p = await FakeEngine("m", role="prefill").start()
        leg1 = {"messages": MSGS, "max_tokens": 1, "kv_transfer_params": LEG1_PARAMS}
        kvp = (await post(session, p.base_url + CHAT, leg1))[1]["kv_transfer_params"]
        await p.aclose()
        events = await sse(
            session, d.base_url + CHAT, {"messages": MSGS, "kv_transfer_params": kvp}
        )
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[1]["error"]["code"] == 500
        assert events[2] == "[DONE]"
        d.kv_load_failure_policy = "recompute"
        status, _body = await post(
            session, d.base_url + CHAT, {"messages": MSGS, "kv_transfer_params": kvp}
        )
        assert status == 200
        assert d.stats.num_local_prefills == 1
        assert d.stats.num_kv_load_failures == 2
        assert d.stats.prompt_tokens_local_compute == 7
        # malformed leg-2 params (e.g. the gateway dropped remote_block_ids) fail the same way
        bad = {k: v for k, v in kvp.items() if k != "remote_block_ids"}
        d.kv_load_failure_policy = "fail"
        status, _ = await post(
            session, d.base_url + CHAT, {"messages": MSGS, "kv_transfer_params": bad}
        )
        assert status == 500


async def test_kv_lease_expiry(session: aiohttp.ClientSession) -> None:
    async with FakeEngine("m", role="prefill") as p, FakeEngine("m", role="decode") as d:
        p.kv_lease_s = 0.0  # the decode leg comes too late: prefill already freed the blocks
        leg1 = {"messages": MSGS, "max_tokens": 1, "kv_transfer_params": LEG1_PARAMS}
        kvp = (await post(session, p.base_url + CHAT, leg1))[1]["kv_transfer_params"]
        status, _ = await post(
            session, d.base_url + CHAT, {"messages": MSGS, "kv_transfer_params": kvp}
        )
        assert status == 500
        assert p.stats.num_kv_expired == 1
        async with session.get(p.base_url + "/metrics") as r:
            assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="m"} 1.0' in (
                await r.text()
            )


async def test_fail_status_and_garbage(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    engine.fail_status, engine.fail_times = 500, 1
    status, body = await post(session, engine.base_url + CHAT, {"messages": MSGS})
    assert status == 500
    assert body == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    status, _ = await post(session, engine.base_url + CHAT, {"messages": MSGS})
    assert status == 200
    assert engine.fail_times == 0
    engine.fail_status, engine.fail_times = None, None
    engine.garbage_response = True
    async with session.post(engine.base_url + CHAT, json={"messages": MSGS}) as r:
        assert r.status == 200
        with pytest.raises(json.JSONDecodeError):
            json.loads(await r.text())


async def test_die_after_tokens(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    engine.die_after_tokens = 2
    async with session.post(engine.base_url + CHAT, json={"messages": MSGS, "stream": True}) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await post(session, engine.base_url + CHAT, {"messages": MSGS})
    assert engine.stats.num_killed == 2
    assert engine.stats.num_aborted == 0
    assert engine.stats.num_running == 0


async def test_error_after_tokens(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    engine.error_after_tokens = 1
    events = await sse(session, engine.base_url + CHAT, {"messages": MSGS})
    assert events[1]["choices"][0]["delta"]["content"]
    assert events[2]["error"]["type"] == "InternalServerError"
    assert events[3] == "[DONE]"


async def test_client_disconnect_is_aborted(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.token_delay_s = 0.05
    r = await session.post(engine.base_url + CHAT, json={"messages": MSGS, "stream": True})
    await r.content.readuntil(b"\n\n")
    assert engine.stats.num_running == 1
    r.close()
    for _ in range(100):
        if engine.stats.num_aborted:
            break
        await asyncio.sleep(0.01)
    assert engine.stats.num_aborted == 1
    assert engine.stats.num_running == 0
    assert engine.stats.finished.get("abort") == 1


async def test_delays_and_waiting(engine: FakeEngine, session: aiohttp.ClientSession) -> None:
    engine.first_token_delay_s, engine.max_num_seqs = 0.2, 1
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = [asyncio.create_task(post(session, engine.base_url + CHAT, {"messages": MSGS}))
             for _ in range(2)]  # fmt: skip
    await asyncio.sleep(0.1)
    assert engine.stats.num_running == 1
    assert engine.stats.num_waiting == 1
    async with session.get(engine.base_url + "/metrics") as r:
        assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0' in await r.text()
    assert [s for s, _ in await asyncio.gather(*tasks)] == [200, 200]
    assert loop.time() - start >= 0.4
    assert engine.stats.num_waiting == 0
    # a client that gives up while queued is an abort, and frees its place in the queue
    tasks = [asyncio.create_task(post(session, engine.base_url + CHAT, {"messages": MSGS}))
             for _ in range(2)]  # fmt: skip
    await asyncio.sleep(0.1)
    tasks[1].cancel()
    await asyncio.sleep(0.05)
    assert engine.stats.num_waiting == 0
    assert engine.stats.num_aborted == 1
    assert (await tasks[0])[0] == 200
    assert engine.stats.num_running == 0


async def test_process_form(session: aiohttp.ClientSession) -> None:
    cmd = ["-m", "tests.fakes.fake_engine", "--served-model-name", "pm", "--role", "prefill"]
    cmd += ["--scheduling-policy", "priority", "--kv-capacity-seqs", "2"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *cmd, "--fail-status", "503", cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()
        assert line[0] == "FAKE_ENGINE_READY"
        url = line[1]
        status, body = await post(session, url + CHAT, {"messages": MSGS})
        assert status == 503
        assert body["error"]["code"] == 503
        async with session.post(url + "/_fake/config", json={"fail_status": None}) as r:
            assert r.status == 200
            knobs = await r.json()
        assert (knobs["scheduling_policy"], knobs["kv_capacity_seqs"]) == ("priority", 2)
        async with session.post(url + "/_fake/config", json={"scheduling_policy": "lifo"}) as r:
            assert r.status == 400
        status, body = await post(session, url + CHAT, {"model": "pm", "messages": MSGS})
        assert status == 200
        assert body["model"] == "pm"
        async with session.get(url + "/_fake/stats") as r:
            stats = await r.json()
        assert stats["num_requests"] == 1
        assert stats["num_failed"] == 1
    finally:
        proc.terminate()
        await proc.wait()


def _tokens(events: list[Any]) -> list[str]:
    """The token texts of a chat stream (role and usage chunks left out)."""
    return [
        e["choices"][0]["delta"]["content"]
        for e in events
        if isinstance(e, dict) and e.get("choices") and "role" not in e["choices"][0]["delta"]
    ]


async def test_waiting_requests_start_by_priority_then_arrival(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.scheduling_policy, engine.max_num_seqs, engine.token_delay_s = "priority", 1, 0.02
    done: list[str] = []

    async def run(name: str, priority: int) -> None:
        body = {"messages": [{"role": "user", "content": name}], "priority": priority}
        status, _ = await post(session, engine.base_url + CHAT, body)
        assert status == 200
        done.append(name)

    tasks = [asyncio.create_task(run("first", 0))]
    await _until(lambda: engine.stats.num_running == 1)
    for k, (name, priority) in enumerate([("late", 5), ("b1", 1), ("urgent", -3), ("b2", 1)]):
        tasks.append(asyncio.create_task(run(name, priority)))
        await _until(lambda k=k: engine.stats.num_waiting == k + 1)  # arrival order is fixed
    await asyncio.gather(*tasks)
    assert done == ["first", "urgent", "b1", "b2", "late"]
    assert engine.stats.num_preemptions == 0  # max_num_seqs waits, it never preempts
    # fcfs (vLLM's default) takes a non-zero priority and ignores it: arrival order
    engine.scheduling_policy = "fcfs"
    done.clear()
    tasks = [asyncio.create_task(run("first", 0))]
    await _until(lambda: engine.stats.num_running == 1)
    for k, (name, priority) in enumerate([("late", 5), ("urgent", -3)]):
        tasks.append(asyncio.create_task(run(name, priority)))
        await _until(lambda k=k: engine.stats.num_waiting == k + 1)
    await asyncio.gather(*tasks)
    assert done == ["first", "late", "urgent"]
    status, body = await post(session, engine.base_url + CHAT, {"messages": MSGS, "priority": "x"})
    assert status == 400
    assert body["error"]["param"] == "body.priority"


async def test_preemption_pauses_the_worst_stream_and_resumes_it_intact(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.output_tokens = 30
    alone = {}
    for name in ("b1", "b2", "b3"):  # the same requests served alone, for reference
        events = await sse(session, engine.base_url + CHAT, _ask(name, stream=True))
        alone[name] = (_tokens(events), events[-2]["usage"])
    engine.scheduling_policy, engine.kv_capacity_seqs, engine.token_delay_s = "priority", 3, 0.02
    received: dict[str, list[str]] = {}
    usage: dict[str, Any] = {}

    async def stream(name: str, priority: int, **extra: Any) -> None:
        received[name] = []
        body = {**_ask(name, stream=True), "priority": priority, **extra}
        async with session.post(engine.base_url + CHAT, json=body) as r:
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                received[name].extend(_tokens([event]))
                usage[name] = event.get("usage") or usage.get(name)

    # worst running = largest (priority, arrival): b3 (priority 2 like b2, but arrived later)
    batch = []
    for name, priority in (("b1", 1), ("b2", 2), ("b3", 2)):
        batch.append(asyncio.create_task(stream(name, priority)))
        await _until(lambda name=name: len(received.get(name, [])) >= 2)
    urgent = asyncio.create_task(stream("urgent", -1, max_tokens=10))  # ends before any batch
    await _until(lambda: engine.stats.num_preemptions == 1)
    paused_at = len(received["b3"])
    assert [r["num_preemptions"] for r in engine.stats.requests[-4:]] == [0, 0, 1, 0]
    assert engine.stats.num_running == 3
    assert engine.stats.num_waiting == 1
    await urgent
    # Paused while the urgent stream ran (10 tokens x 20 ms): at most one chunk was in flight.
    assert len(received["b3"]) - paused_at <= 1
    await asyncio.gather(*batch)
    for name in ("b1", "b2", "b3"):
        assert received[name] == alone[name][0]  # nothing lost, nothing repeated
        assert usage[name] == alone[name][1]
        assert usage[name]["completion_tokens"] == len(received[name])
    assert engine.stats.num_preemptions == 1
    assert engine.stats.num_running == engine.stats.num_waiting == 0
    async with session.get(engine.base_url + "/metrics") as r:
        metrics = await r.text()
    assert 'vllm:num_preemptions_total{engine="0",model_name="m"} 1.0' in metrics


async def test_preempted_non_streaming_request_finishes_whole(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.output_tokens = 20
    _, alone = await post(session, engine.base_url + CHAT, _ask("batch"))
    engine.scheduling_policy, engine.kv_capacity_seqs, engine.token_delay_s = "priority", 1, 0.02
    batch = asyncio.create_task(
        post(session, engine.base_url + CHAT, {**_ask("batch"), "priority": 1})
    )
    await _until(lambda: engine.stats.num_running == 1)
    _, urgent = await post(session, engine.base_url + CHAT, {**_ask("urgent"), "priority": -1})
    assert urgent["choices"][0]["finish_reason"] == "stop"
    assert engine.stats.num_preemptions == 1
    assert not batch.done()  # paused behind it
    _, body = await batch
    assert body["choices"][0]["message"] == alone["choices"][0]["message"]
    assert body["usage"] == alone["usage"]


async def test_the_fifo_policy_never_preempts(
    engine: FakeEngine, session: aiohttp.ClientSession
) -> None:
    engine.kv_capacity_seqs, engine.token_delay_s = 1, 0.02
    batch = asyncio.create_task(post(session, engine.base_url + CHAT, {**_ask("b"), "priority": 1}))
    await _until(lambda: engine.stats.num_running == 1)
    urgent = asyncio.create_task(
        post(session, engine.base_url + CHAT, {**_ask("u"), "priority": -1})
    )
    await _until(lambda: engine.stats.num_waiting == 1)  # kv_capacity_seqs caps running too
    assert [s for s, _ in await asyncio.gather(batch, urgent)] == [200, 200]
    assert engine.stats.num_preemptions == 0


def _ask(name: str, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": f"job {name}"}]}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)
