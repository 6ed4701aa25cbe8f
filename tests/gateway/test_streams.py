"""Streams that never break a client: heartbeats while queued, prefilling or between slow
tokens; deadlines through queue and decode; disconnects stop engine work (docs/WIRE.md §1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack, wait_until

QUESTION = [{"role": "user", "content": "what is the answer"}]
PING_S = 0.2  # the fake stack's heartbeat interval


@pytest.fixture
async def one_slot(tmp_path: Path) -> AsyncIterator[FakeStack]:
    """One request runs at a time, so a second one waits in the queue."""
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        max_in_flight_per_worker=1,
    )
    async with make_fake_stack(access=access) as stack:
        yield stack


@pytest.fixture
async def stack() -> AsyncIterator[FakeStack]:
    async with make_fake_stack() as fake_stack:
        yield fake_stack


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": QUESTION, "stream": True, **fields}


async def _occupy_the_slot(stack: FakeStack, max_tokens: int) -> asyncio.Task[object]:
    """A running request that holds the one slot; the caller awaits it."""
    holder: asyncio.Task[object] = asyncio.create_task(
        stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=max_tokens)
    )
    await wait_until(lambda: stack.decode.stats.num_running == 1)
    return holder


async def _raw_events(stack: FakeStack, body: dict[str, Any], **headers: str) -> list[str]:
    async with (
        httpx.AsyncClient(headers={**stack.auth_headers, **headers}, timeout=30) as http,
        http.stream("POST", f"{stack.base_url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        raw = b"".join([part async for part in response.aiter_bytes()]).decode()
    assert "\r" not in raw
    assert not any(line.startswith(("event:", "id:", "retry:")) for line in raw.split("\n"))
    return [event for event in raw.split("\n\n") if event]


async def test_a_queued_stream_starts_with_heartbeats_and_then_streams(
    one_slot: FakeStack,
) -> None:
    stack = one_slot
    stack.decode.token_delay_s = 0.1
    holder = await _occupy_the_slot(stack, max_tokens=12)
    events = await _raw_events(stack, _body(max_tokens=3, stream_options={"include_usage": True}))
    await holder
    # Queued for ~1 s, past the 0.2 s interval: the stream committed with a heartbeat first.
    assert events[0] == ": ping"
    first_data = next(i for i, event in enumerate(events) if event.startswith("data: "))
    assert first_data >= 2, "heartbeats kept coming while it waited"
    assert all(event == ": ping" for event in events[:first_data])
    assert events[-1] == "data: [DONE]"
    assert '"choices":[]' in events[-2] and '"usage":{' in events[-2]


async def test_the_openai_client_reads_streams_with_heartbeats_and_usage(
    one_slot: FakeStack,
) -> None:
    stack = one_slot
    stack.decode.token_delay_s = 0.3  # slower than the heartbeat: pings between tokens
    holder = await _occupy_the_slot(stack, max_tokens=3)
    stream = await stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    await holder
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert len({chunk.id for chunk in chunks}) == 1
    events = await _raw_events(stack, _body(max_tokens=3))
    between = events[events.index(next(e for e in events if e.startswith("data: "))) :]
    assert ": ping" in between, "pings between slow tokens"


async def test_a_deadline_passing_in_the_queue_after_the_stream_started_is_one_error_event(
    one_slot: FakeStack,
) -> None:
    stack = one_slot
    stack.decode.token_delay_s = 0.1
    holder = await _occupy_the_slot(stack, max_tokens=15)
    events = await _raw_events(stack, _body(max_tokens=3), **{"x-tandem-timeout-ms": "600"})
    await holder
    assert events[0] == ": ping"
    [error] = [event for event in events if event.startswith("data: ")]
    assert '"code":"deadline_exceeded"' in error
    assert "[DONE]" not in events[-1]
    assert len(stack.decode.stats.requests) == 1, "the expired request never ran"

    stack.decode.token_delay_s = 0.1
    holder = await _occupy_the_slot(stack, max_tokens=15)
    stream = await stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, stream=True,
        extra_headers={"x-tandem-timeout-ms": "600"},
    )  # fmt: skip
    with pytest.raises(openai.APIError) as caught:
        async for _ in stream:
            pass
    await holder
    assert "deadline" in caught.value.message


async def test_a_deadline_during_decode_ends_the_stream_and_aborts_the_engine(
    stack: FakeStack,
) -> None:
    stack.decode.token_delay_s = 0.05
    stack.decode.output_tokens = 500  # would run ~25 s
    stream = await stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, stream=True,
        extra_headers={"x-tandem-timeout-ms": "500"},
    )  # fmt: skip
    received: list[str] = []

    async def consume() -> None:
        async for chunk in stream:
            if chunk.choices:
                received.append(chunk.choices[0].delta.content or "")

    with pytest.raises(openai.APIError) as caught:
        await consume()
    assert "deadline" in caught.value.message
    assert 1 < len(received) < 50
    await wait_until(lambda: stack.decode.stats.num_aborted == 1)
    assert stack.decode.stats.num_running == 0


async def test_a_non_streaming_deadline_is_504_not_to_be_retried(stack: FakeStack) -> None:
    stack.decode.token_delay_s = 0.05
    stack.decode.output_tokens = 500  # would run ~25 s
    async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.auth_headers) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": QUESTION, "max_tokens": 200},
            headers={"x-tandem-timeout-ms": "300"},
        )
        assert response.status_code == 504
        assert response.json()["error"]["code"] == "deadline_exceeded"
        assert response.headers["x-should-retry"] == "false"
        assert response.headers["x-request-id"]
        await wait_until(lambda: stack.decode.stats.num_aborted == 1)
        for bad in ("0", "-5", "soon", "inf"):
            rejected = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": QUESTION, "max_tokens": 2},
                headers={"x-tandem-timeout-ms": bad},
            )
            assert rejected.status_code == 400, bad
            assert rejected.json()["error"]["param"] == "x-tandem-timeout-ms"


async def test_a_client_leaving_a_non_streaming_request_stops_the_engine(
    stack: FakeStack,
) -> None:
    stack.decode.token_delay_s = 0.05
    stack.decode.output_tokens = 500  # would run ~25 s
    async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.auth_headers) as http:
        call = asyncio.create_task(
            http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": QUESTION, "max_tokens": 200},
            )
        )
        await wait_until(lambda: stack.decode.stats.num_running == 1)
        call.cancel()  # the client hangs up
        with pytest.raises(asyncio.CancelledError):
            await call
    await wait_until(lambda: stack.decode.stats.num_aborted == 1)
    await wait_until(lambda: stack.decode_pool.workers[0].num_outstanding == 0)
    assert stack.decode.stats.num_running == 0


@pytest.mark.parametrize("http", [None, "h11"], ids=["gateway", "h11"])
async def test_a_client_leaving_a_stream_before_its_first_token_stops_the_engine(
    http: str | None,
) -> None:
    """A stream commits at its first token or after a heartbeat interval (60 s here): a client
    that leaves before either is heard at once, not when the stream would have committed."""
    async with make_fake_stack(
        gateway={"sse_ping_interval_s": 60.0},
        http=http,
        prefill_timeout_s=60,
        decode_idle_timeout_s=60,
        first_byte_timeout_s=60,
    ) as stack:
        engines = (stack.prefill, stack.decode)
        for engine in engines:
            engine.first_token_delay_s = 30.0
        async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.auth_headers) as client:
            call = asyncio.create_task(
                client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": QUESTION, "max_tokens": 8, "stream": True},
                )
            )
            await wait_until(lambda: sum(e.stats.num_running for e in engines) == 1)
            call.cancel()  # the client hangs up while the engine works on its first token
            with pytest.raises(asyncio.CancelledError):
                await call
        await wait_until(lambda: sum(e.stats.num_aborted for e in engines) == 1)
        await wait_until(lambda: sum(e.stats.num_running for e in engines) == 0)
        await wait_until(lambda: all(w.num_outstanding == 0 for w in stack.decode_pool.workers))
