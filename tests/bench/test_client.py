"""The harness's client against real servers on 127.0.0.1: the fake vLLM engine for honest
streams, and a scripted server for every way a stream can break."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from bench.harness.client import send
from bench.harness.dataset import Prompt
from bench.harness.records import RequestRecord
from bench.harness.workload import Api, PlannedRequest, Target, TenantSpec
from tests.fakes.fake_engine import FakeEngine
from tests.http_app import served

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'


def token(text: str, finish: str | None = None) -> bytes:
    reason = f'"{finish}"' if finish else "null"
    return (
        f'data: {{"choices":[{{"index":0,"delta":{{"content":"{text}"}},'
        f'"finish_reason":{reason}}}]}}\n\n'
    ).encode()


def usage(completion: int) -> bytes:
    return (
        f'data: {{"choices":[],"usage":{{"prompt_tokens":3,"completion_tokens":{completion},'
        f'"total_tokens":{3 + completion}}}}}\n\n'
    ).encode()


DONE = b"data: [DONE]\n\n"
GOOD = [ROLE, token("a"), token(" b"), token(" c", "stop"), usage(3), DONE]
SCRIPTS: dict[str, list[bytes]] = {
    "good": GOOD,
    "heartbeats": [b": ping\n\n", ROLE, b": ping\n\n", *GOOD[1:]],
    "crlf": [part.replace(b"\n", b"\r\n") for part in GOOD],
    "no-done": GOOD[:-1],
    "no-finish": [ROLE, token("a"), token(" b"), usage(2), DONE],
    "no-usage": [ROLE, token("a"), token(" b", "stop"), DONE],
    "not-json": [ROLE, b"data: {oops\n\n", *GOOD[1:]],
    "not-sse": [ROLE, b"hello there\n\n", *GOOD[1:]],
    "usage-too-low": [ROLE, token("a"), token(" b"), token(" c", "stop"), usage(1), DONE],
    "usage-over-max": [ROLE, token("a", "length"), usage(99), DONE],
    "error-event": [
        ROLE,
        token("a"),
        b'data: {"error":{"message":"engine died","type":"server_error","code":"engine_error"}}\n\n',
        DONE,
    ],
    "data-after-done": [*GOOD, token("late")],
    "ten-tokens": [
        ROLE,
        *(token(f" w{i}") for i in range(9)),
        token(" end", "stop"),
        usage(10),
        DONE,
    ],
}


def planned(max_tokens: int = 16, key: str | None = None) -> PlannedRequest:
    return PlannedRequest(
        index=0,
        tenant=TenantSpec("t", api_key=key),
        prompt=Prompt("hello there", tokens=2, output_tokens=max_tokens, prefix_group=None),
        warmup=False,
        scheduled_s=None,
    )


def new_record(max_tokens: int = 16) -> RequestRecord:
    return RequestRecord(0, "t", False, None, max_tokens=max_tokens, expected_prompt_tokens=2)


@pytest.fixture
async def scripted() -> AsyncIterator[str]:
    seen: list[dict[str, str]] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        name = request.match_info["name"]
        if name == "rate-limited":
            return web.json_response(
                {
                    "error": {
                        "message": "slow down",
                        "type": "requests",
                        "code": "rate_limit_exceeded",
                    }
                },
                status=429,
                headers={"x-request-id": "req-1"},
            )
        if name == "vllm-400":
            return web.json_response(
                {"error": {"message": "too long", "type": "BadRequestError", "code": 400}},
                status=400,
            )
        if name == "slow":
            await asyncio.sleep(5)
        response = web.StreamResponse(
            headers={"content-type": "text/event-stream", "x-tandem-queue-ms": "12.5"}
        )
        await response.prepare(request)
        for part in SCRIPTS[name]:
            await response.write(part)
            await asyncio.sleep(0.005)
        return response

    app = web.Application()
    app.router.add_post("/{name}/v1/chat/completions", stream)
    async with served(app) as base_url:
        yield base_url


async def run_script(
    base: str, name: str, max_tokens: int = 16, timeout_s: float = 5
) -> RequestRecord:
    target = Target(base_url=f"{base}/{name}", model="m", timeout_s=timeout_s)
    async with aiohttp.ClientSession() as session:
        return await send(session, target, planned(max_tokens), new_record(max_tokens), 0.0)


@pytest.mark.parametrize("name", ["good", "heartbeats", "crlf"])
async def test_a_good_stream_is_measured_with_vllm_definitions(scripted: str, name: str) -> None:
    r = await run_script(scripted, name)
    assert r.ok, r.error
    assert (r.content_chunks, r.completion_tokens, r.prompt_tokens) == (3, 3, 3)
    assert r.text == "a b c" and r.finish_reason == "stop"
    assert r.ttft_s is not None and r.ttft_content_s is not None
    assert r.ttft_s < r.ttft_content_s  # the role chunk starts vLLM's TTFT
    assert len(r.itl_s) == 3  # one gap per chunk with a choice after the first
    assert r.e2e_s == pytest.approx(r.ttft_s + sum(r.itl_s))
    assert r.queue_ms == 12.5


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("no-done", "without data: [DONE]"),
        ("no-finish", "no finish_reason"),
        ("no-usage", "no usage"),
        ("not-json", "not JSON"),
        ("not-sse", "not an SSE line"),
        ("usage-too-low", "usage says 1 tokens but 3 chunks had text"),
        ("usage-over-max", "over max_tokens 16"),
        ("data-after-done", "data after [DONE]"),
    ],
)
async def test_a_broken_stream_is_a_malformed_failure(
    scripted: str, name: str, reason: str
) -> None:
    r = await run_script(scripted, name)
    assert not r.ok and r.error_type == "malformed"
    assert any(reason in problem for problem in r.malformed), r.malformed


async def test_an_error_event_mid_stream_fails_with_its_code(scripted: str) -> None:
    r = await run_script(scripted, "error-event")
    assert not r.ok and r.status == 200
    assert r.error_type == "stream_error:engine_error" and r.error == "engine died"


async def test_http_errors_are_classified_by_openai_code_else_type(scripted: str) -> None:
    limited = await run_script(scripted, "rate-limited")
    assert (limited.status, limited.error_type, limited.error) == (
        429,
        "rate_limit_exceeded",
        "slow down",
    )
    assert limited.request_id == "req-1"
    vllm = await run_script(scripted, "vllm-400")
    assert (vllm.status, vllm.error_type) == (400, "BadRequestError")


async def test_timeouts_and_refused_connections_are_failures_not_exceptions(scripted: str) -> None:
    slow = await run_script(scripted, "slow", timeout_s=0.2)
    assert slow.error_type == "timeout" and 0.2 <= slow.elapsed_s < 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    refused = await run_script(f"http://127.0.0.1:{closed_port}", "good")
    assert refused.error_type == "connection" and refused.status is None


async def test_usage_far_from_the_streamed_text_is_malformed(scripted: str) -> None:
    target = Target(base_url=f"{scripted}/good", model="m")
    async with aiohttp.ClientSession() as session:
        honest = await send(session, target, planned(), new_record(), 0.0, lambda t: len(t.split()))
        lying = await send(session, target, planned(), new_record(), 0.0, lambda t: 40)
        ten = Target(base_url=f"{scripted}/ten-tokens", model="m")
        inflated = await send(session, ten, planned(), new_record(), 0.0, lambda t: 0)
        eos_target = Target(base_url=f"{scripted}/ten-tokens", model="m", ignore_eos=True)
        invisible = await send(session, eos_target, planned(), new_record(), 0.0, lambda t: 0)
    assert honest.ok
    assert lying.error_type == "malformed" and "the streamed text is 40" in (lying.error or "")
    assert inflated.error_type == "malformed" and "the streamed text is only 0" in (
        inflated.error or ""
    )
    # With ignore_eos the model may stream any number of special tokens that have no text.
    assert invisible.ok


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
async def test_against_the_fake_vllm_engine(api: Api) -> None:
    engine = await FakeEngine("m", output_tokens=6).start()
    engine.token_delay_s = 0.01
    try:
        target = Target(base_url=engine.base_url + "/v1", model="m", api=api)
        async with aiohttp.ClientSession() as session:
            r = await send(session, target, planned(max_tokens=4, key="sk-1"), new_record(4), 0.0)
        body = engine.stats.requests[-1]
    finally:
        await engine.aclose()
    assert r.ok, r.error
    assert r.finish_reason == "length" and r.completion_tokens == 4 and r.content_chunks == 4
    # Chat's role chunk adds one gap (vLLM's ITL counts every chunk with a choice).
    assert len(r.itl_s) == (4 if api is Api.CHAT else 3)
    assert sum(r.itl_s) >= 0.03
    assert body["headers"]["Authorization"] == "Bearer sk-1"
    assert body["body"]["stream_options"] == {"include_usage": True}
    assert ("messages" in body["body"]) is (api is Api.CHAT)
