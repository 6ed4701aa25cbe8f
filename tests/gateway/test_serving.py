"""Gateway behaviour over fake engines: the two legs, the stream relay, errors, disconnects."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import openai
import pytest

from core.models import ServedModel
from kv_transfer.connector import ConnectorConfig
from kv_transfer.decider import DeciderConfig
from kv_transfer.geometry import KvGeometry
from tests.gateway.conftest import MODEL, FakeStack, make_fake_stack, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _header(recorded: dict[str, Any], name: str) -> str:
    return next(v for k, v in recorded["headers"].items() if k.lower() == name)


async def test_chat_runs_prefill_leg_then_decode_leg_with_the_handle(fake_stack: FakeStack) -> None:
    completion = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, stream_options=None
    )
    assert completion.choices[0].finish_reason == "length"
    [leg1] = fake_stack.prefill.stats.requests
    [leg2] = fake_stack.decode.stats.requests
    assert leg1["body"]["max_tokens"] == 1
    assert leg1["body"]["stream"] is False
    assert leg1["body"]["kv_transfer_params"]["do_remote_decode"] is True
    handle = leg2["body"]["kv_transfer_params"]
    assert handle["do_remote_prefill"] is True
    assert handle["remote_engine_id"] == fake_stack.prefill.engine_id
    # One request id travels with both legs.
    assert _header(leg1, "x-request-id") == _header(leg2, "x-request-id")
    assert fake_stack.decode.stats.num_remote_prefills == 1
    assert fake_stack.decode.stats.num_local_prefills == 0
    assert completion.id == f"chatcmpl-{_header(leg2, 'x-request-id')}"


async def test_stream_without_include_usage_has_no_usage_anywhere(fake_stack: FakeStack) -> None:
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.choices for chunk in chunks), "the usage chunk was stripped"
    assert all("usage" not in chunk.model_dump(exclude_unset=True) for chunk in chunks)
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert len({chunk.created for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    # The finish reason arrives alone, with an empty delta, as OpenAI sends it.
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not chunks[-1].choices[0].delta.content
    assert sum(1 for chunk in chunks if chunk.choices[0].delta.content) == 4
    # The engine was still asked for usage (billing needs it).
    [leg2] = fake_stack.decode.stats.requests
    assert leg2["body"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


async def test_stream_with_include_usage_has_one_usage_chunk_last(fake_stack: FakeStack) -> None:
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert [chunk.usage is not None for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_raw_sse_framing(fake_stack: FakeStack) -> None:
    async with (
        httpx.AsyncClient(headers=fake_stack.auth_headers) as http,
        http.stream(
            "POST",
            f"{fake_stack.base_url}/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True},
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        raw = b"".join([part async for part in response.aiter_bytes()])
    assert b"\r" not in raw
    events = [event for event in raw.decode().split("\n\n") if event]
    assert all(event.startswith(("data: ", ": ping")) for event in events)
    assert events[-1] == "data: [DONE]"
    assert not any(
        line.startswith(("event:", "id:", "retry:")) for line in raw.decode().split("\n")
    )


async def test_completions_non_streaming(fake_stack: FakeStack) -> None:
    completion = await fake_stack.client.completions.create(
        model=MODEL, prompt="one two three", max_tokens=2
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.usage is not None and completion.usage.completion_tokens == 2


async def test_n_greater_than_one_runs_colocated(fake_stack: FakeStack) -> None:
    completion = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, n=2
    )
    assert len(completion.choices) == 2
    assert fake_stack.prefill.stats.requests == []
    assert fake_stack.decode.stats.num_local_prefills == 1


async def test_unknown_model_is_404(fake_stack: FakeStack) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await fake_stack.client.chat.completions.create(model="nope", messages=QUESTION)
    assert caught.value.code == "model_not_found"
    assert fake_stack.prefill.stats.requests == []


async def test_prompt_too_long_is_400_context_length_exceeded(fake_stack: FakeStack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await fake_stack.client.completions.create(model=MODEL, prompt="word " * 400)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "prompt"


async def test_no_healthy_decode_worker_is_503_with_retry_after(fake_stack: FakeStack) -> None:
    fake_stack.decode.healthy = False
    await wait_until(lambda: not fake_stack.decode_pool.workers[0].healthy)
    async with httpx.AsyncClient(headers=fake_stack.auth_headers) as http:
        response = await http.post(
            f"{fake_stack.base_url}/v1/chat/completions",
            json={"model": MODEL, "messages": QUESTION},
        )
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "no_healthy_worker"
    ready = await httpx.AsyncClient().get(f"{fake_stack.base_url}/ready")
    assert ready.status_code == 503


async def test_prefill_failure_falls_back_to_colocated(fake_stack: FakeStack) -> None:
    fake_stack.prefill.fail_status = 500
    completion = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3
    )
    assert completion.choices[0].finish_reason == "length"
    [leg2] = fake_stack.decode.stats.requests
    assert "kv_transfer_params" not in leg2["body"], "no junk handle after a failed prefill"
    assert fake_stack.decode.stats.num_local_prefills == 1
    metrics = await _metrics(fake_stack)
    assert (
        'tandem_requests_total{model="fake-model",outcome="finished",path="fallback",reason="prefill_failed",version="fake-model"} 1.0'
        in metrics
    )


async def test_a_handle_past_its_lease_is_not_forwarded() -> None:
    decider = DeciderConfig(min_prompt_tokens=0)
    connector = ConnectorConfig(kv_lease_s=0)
    async with make_fake_stack(gateway={"decider": decider, "connector": connector}) as stack:
        completion = await stack.client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=3
        )
        [leg2] = stack.decode.stats.requests
        metrics = await _metrics(stack)
    assert completion.choices[0].finish_reason == "length"
    assert "kv_transfer_params" not in leg2["body"]
    assert stack.decode.stats.num_local_prefills == 1
    assert (
        'tandem_requests_total{model="fake-model",outcome="finished",path="fallback",reason="kv_expired",version="fake-model"} 1.0'
        in metrics
    )


async def test_metrics_count_paths_tokens_and_worker_state(fake_stack: FakeStack) -> None:
    await fake_stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, n=2
    )
    metrics = await _metrics(fake_stack)
    assert (
        'tandem_requests_total{model="fake-model",outcome="finished",path="disaggregated",reason="long_prompt",version="fake-model"} 1.0'
        in metrics
    )
    assert (
        'tandem_requests_total{model="fake-model",outcome="finished",path="colocated",reason="n_gt_1",version="fake-model"} 1.0'
        in metrics
    )
    assert (
        'tandem_tokens_total{kind="completion",model="fake-model",version="fake-model"} 6.0'
        in metrics
    )
    assert 'tandem_worker_healthy{role="decode",worker="decode-ext-0"} 1.0' in metrics
    ttft = 'tandem_time_to_first_token_seconds_count{band="standard",path="disaggregated",version="fake-model"} 1.0'
    assert ttft in metrics
    # The workers' own counters, re-exported per worker.
    assert re.search(
        r'^tandem_worker_prefix_cache_queries_total\{worker="prefill-ext-0",role="prefill"\} [1-9]',
        metrics,
        re.M,
    )
    assert re.search(
        r'^tandem_worker_kv_transfers_total\{worker="decode-ext-0",role="decode"\} 1\.0$',
        metrics,
        re.M,
    )


async def test_metrics_show_each_bands_longest_stream_pause(fake_stack: FakeStack) -> None:
    fake_stack.decode.token_delay_s = 0.05
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, stream=True
    )
    async for _ in stream:
        pass
    metrics = await _metrics(fake_stack)
    assert 'tandem_stream_longest_pause_seconds_count{band="standard"} 1.0' in metrics
    [longest] = re.findall(
        r'^tandem_stream_longest_pause_seconds_sum\{band="standard"\} (\S+)$', metrics, re.M
    )
    assert 0.04 <= float(longest) < 1.0  # one token delay, not the whole stream


async def test_metrics_say_which_workers_served_and_what_the_hand_off_cost() -> None:
    # 2 layers x 1 KV head x 4 dims x 4 bytes, K and V: 64 bytes a token, 1 KiB a 16-token block.
    geometry = KvGeometry(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=4, block_size=16)
    async with make_fake_stack(
        model=ServedModel(MODEL, 256, 0, kv_block_bytes=geometry.bytes_per_block)
    ) as stack:
        await stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        [leg1] = stack.prefill.stats.requests
        [leg2] = stack.decode.stats.requests
        num_blocks = len(leg2["body"]["kv_transfer_params"]["remote_block_ids"][0])
        assert num_blocks >= 1 and leg1["body"]["max_tokens"] == 1
        # n > 1 runs colocated (this stack splits everything else).
        await stack.client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2, n=2
        )
        metrics = await _metrics(stack)
    routes = "tandem_routed_requests_total"
    assert (
        f'{routes}{{decode_worker="decode-ext-0",path="disaggregated",prefill_worker="prefill-ext-0"}}'
        " 1.0" in metrics
    )
    assert (
        f'{routes}{{decode_worker="decode-ext-0",path="colocated",prefill_worker="none"}} 1.0'
        in metrics
    )
    assert 'tandem_prefill_leg_seconds_count{prefill_worker="prefill-ext-0"} 1.0' in metrics
    for path in ("disaggregated", "colocated"):
        assert (
            f'tandem_decode_first_token_seconds_count{{decode_worker="decode-ext-0",path="{path}"}}'
            " 1.0" in metrics
        )
    assert (
        'tandem_kv_handoff_bytes_sum{decode_worker="decode-ext-0",prefill_worker="prefill-ext-0"} '
        f"{float(num_blocks * 1024)}" in metrics
    )


async def _metrics(fake_stack: FakeStack) -> str:
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{fake_stack.base_url}/metrics")
    assert response.status_code == 200
    return response.text


async def test_engine_failure_is_502_with_a_string_code(fake_stack: FakeStack) -> None:
    fake_stack.decode.fail_status = 500  # vLLM's body has an integer code
    with pytest.raises(openai.InternalServerError) as caught:
        await fake_stack.client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)
    assert caught.value.status_code == 502
    assert caught.value.code == "engine_error"


async def test_garbage_from_engine_is_502(fake_stack: FakeStack) -> None:
    fake_stack.decode.garbage_response = True
    with pytest.raises(openai.InternalServerError) as caught:
        await fake_stack.client.chat.completions.create(model=MODEL, messages=QUESTION)
    assert caught.value.status_code == 502


async def test_decode_dying_mid_stream_ends_with_one_error_event(fake_stack: FakeStack) -> None:
    fake_stack.decode.die_after_tokens = 2
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, stream=True
    )
    received: list[object] = []

    async def consume() -> None:
        async for chunk in stream:
            received.append(chunk)

    with pytest.raises(openai.APIError) as caught:
        await consume()
    assert received, "chunks before the failure reached the client"
    assert "decode worker" in caught.value.message
    await wait_until(lambda: fake_stack.decode_pool.workers[0].num_outstanding == 0)


@pytest.mark.parametrize("http", [None, "httptools", "h11"], ids=["gateway", "httptools", "h11"])
async def test_client_disconnect_aborts_the_engine_request(http: str | None) -> None:
    # The gateway's own server signals the hang-up (gateway/cli/http_protocol.py); any other
    # server is watched through receive() (gateway/serving/hangup.py).
    async with make_fake_stack(http=http) as stack:
        stack.decode.token_delay_s = 0.05
        stream = await stack.client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=200, stream=True
        )
        async for _ in stream:
            break
        await stream.close()
        await wait_until(lambda: stack.decode.stats.num_aborted == 1)
        await wait_until(lambda: stack.decode_pool.workers[0].num_outstanding == 0)
        assert stack.decode.stats.num_running == 0


async def test_bad_bodies_are_400_in_openai_shape(fake_stack: FakeStack) -> None:
    cases = [
        (b"{oops", None),
        (b"[1, 2]", None),
        (b'{"model": "fake-model"}', "messages"),
        (
            b'{"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]}',
            "messages.0.role",
        ),
        (b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (
            b'{"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "stop": ["a","b","c","d","e"]}',
            "stop",
        ),
    ]
    async with httpx.AsyncClient(headers=fake_stack.auth_headers) as http:
        for body, param in cases:
            response = await http.post(
                f"{fake_stack.base_url}/v1/chat/completions",
                content=body,
                headers={"Content-Type": "application/json"},
            )
            assert response.status_code == 400, body
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param or (param and error["param"].startswith(param)), body


async def test_unknown_route_and_method_are_openai_errors(fake_stack: FakeStack) -> None:
    async with httpx.AsyncClient() as http:
        missing = await http.get(f"{fake_stack.base_url}/v1/nothing")
        wrong_method = await http.get(f"{fake_stack.base_url}/v1/chat/completions")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}
    assert wrong_method.status_code == 405 and set(wrong_method.json()) == {"error"}


async def test_unknown_fields_pass_through_to_the_engine(fake_stack: FakeStack) -> None:
    await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, extra_body={"top_k": 5}
    )
    [leg2] = fake_stack.decode.stats.requests
    assert leg2["body"]["top_k"] == 5


async def test_client_cannot_inject_kv_transfer_params(fake_stack: FakeStack) -> None:
    smuggled = {"do_remote_prefill": True, "remote_engine_id": "someone-else"}
    await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, n=2,  # colocated path
        extra_body={"kv_transfer_params": smuggled},
    )  # fmt: skip
    [request] = fake_stack.decode.stats.requests
    assert "kv_transfer_params" not in request["body"]


async def test_concurrent_streams_are_balanced_and_complete(fake_stack: FakeStack) -> None:
    async def one() -> int:
        stream = await fake_stack.client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=5, stream=True
        )
        return sum(
            [1 async for chunk in stream if chunk.choices and chunk.choices[0].delta.content]
        )

    counts = await asyncio.gather(*(one() for _ in range(20)))
    assert counts == [5] * 20
    assert fake_stack.decode_pool.workers[0].num_outstanding == 0


async def test_decode_failure_before_first_byte_is_rerun_colocated(fake_stack: FakeStack) -> None:
    fake_stack.decode.fail_status, fake_stack.decode.fail_times = 500, 1
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    first, retry = fake_stack.decode.stats.requests
    assert "kv_transfer_params" in first["body"]
    assert "kv_transfer_params" not in retry["body"], "the re-run is colocated"
    assert retry["body"]["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    assert 'path="fallback",reason="decode_failed",version="fake-model"} 1.0' in await _metrics(
        fake_stack
    )


async def test_stalled_first_byte_is_rerun_on_another_decode_worker() -> None:
    async with make_fake_stack(num_decode=2, first_byte_timeout_s=0.5) as stack:
        stalled, healthy = stack.decodes
        stalled.first_token_delay_s = 30
        stream = await stack.client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=3, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text
        assert len(stalled.stats.requests) == 1
        [rerun] = healthy.stats.requests
        assert "kv_transfer_params" not in rerun["body"]
        await wait_until(lambda: stalled.stats.num_aborted == 1)  # the stalled leg was dropped


@pytest.mark.parametrize("stream", [True, False])
async def test_a_prefill_worker_lost_during_the_hand_off_is_not_waited_for(stream: bool) -> None:
    """The decode worker would wait out its NIXL timeouts on the dead peer (here: the 30 s
    first-byte timeout); the gateway sees the prefill worker leave rotation and re-runs the
    request colocated at once."""
    async with make_fake_stack(num_decode=2, first_byte_timeout_s=30) as stack:
        reading, other = stack.decodes
        reading.first_token_delay_s = 30  # stuck reading KV from the prefill worker

        async def lose_prefill_after_leg_1() -> None:
            await wait_until(lambda: len(reading.stats.requests) == 1)
            stack.prefill.healthy = False

        loser = asyncio.create_task(lose_prefill_after_leg_1())
        completion = await stack.client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=3, stream=stream
        )
        if stream:
            assert isinstance(completion, openai.AsyncStream)
            text = "".join(
                [c.choices[0].delta.content or "" async for c in completion if c.choices]
            )
        else:
            text = completion.choices[0].message.content or ""
        await loser
        assert text
        [rerun] = other.stats.requests
        assert "kv_transfer_params" not in rerun["body"], "the re-run is colocated"
        await wait_until(lambda: reading.stats.num_aborted == 1)  # the stuck leg was dropped
        metrics = await _metrics(stack)
    assert 'path="fallback",reason="prefill_lost",version="fake-model"} 1.0' in metrics


async def test_non_streaming_timeout_is_not_retried() -> None:
    async with make_fake_stack(decode_idle_timeout_s=0.5) as stack:
        stack.decode.first_token_delay_s = 30
        with pytest.raises(openai.APIStatusError) as caught:
            await stack.client.chat.completions.create(model=MODEL, messages=QUESTION)
        assert caught.value.status_code == 504
        assert len(stack.decode.stats.requests) == 1


async def test_shared_prefixes_stick_to_one_prefill_worker() -> None:
    async with make_fake_stack(num_prefill=2) as stack:
        system = {"role": "system", "content": "You are a pirate. " * 20}
        for i in range(6):
            await stack.client.chat.completions.create(
                model=MODEL,
                messages=[system, {"role": "user", "content": f"question {i}"}],
                max_tokens=1,
            )
        counts = sorted(len(engine.stats.requests) for engine in stack.prefills)
        assert counts == [0, 6], "one system prompt, one prefill worker"

        for engine in stack.prefills:
            engine.reset_stats()
        for i in range(20):
            await stack.client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"unrelated prompt number {i}"}],
                max_tokens=1,
            )
        assert all(engine.stats.requests for engine in stack.prefills), "prefixes spread"
