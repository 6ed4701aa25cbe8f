"""One trace per request on the gateway over fake engines, exported over OTLP/HTTP to a
receiver that decodes the protobuf (tests/otlp_receiver.py). The same tree with vLLM's own span
joined is checked on real workers in tests/e2e/test_tracing.py."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from telemetry.tracing import TracingConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from tests.otlp_receiver import SPLIT_STREAM_STEPS, OtlpReceiver, ReceivedSpan

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
SERVER, CLIENT = 2, 3  # the proto's SpanKind
ERROR = 2  # the proto's StatusCode


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = await OtlpReceiver().start()
    yield receiver
    await receiver.aclose()


@pytest.fixture(autouse=True)
def quick_export(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms between batches


async def _stack(receiver: OtlpReceiver, **tracing: float) -> AsyncIterator[FakeStack]:
    config = TracingConfig(traces_endpoint=receiver.url, **tracing)  # type: ignore[arg-type]
    async with make_fake_stack(gateway={"tracing": config}) as stack:
        yield stack


@pytest.fixture
async def stack(receiver: OtlpReceiver) -> AsyncIterator[FakeStack]:
    async for stack in _stack(receiver):
        yield stack


def _root(spans: list[ReceivedSpan]) -> ReceivedSpan:
    roots = [s for s in spans if s.kind == SERVER and s.service == "tandem-gateway"]
    assert len(roots) == 1, [s.name for s in roots]
    return roots[0]


def _by_name(spans: list[ReceivedSpan]) -> dict[str, list[ReceivedSpan]]:
    named: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        named.setdefault(span.name, []).append(span)
    return named


def _has_root(trace_id: str) -> Callable[[list[ReceivedSpan]], bool]:
    return lambda spans: any(s.trace_id == trace_id and s.kind == SERVER for s in spans)


async def test_a_disaggregated_stream_is_one_trace_under_the_clients_span(
    stack: FakeStack, receiver: OtlpReceiver
) -> None:
    stream = await stack.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=8,
        stream=True,
        extra_headers=TRACEPARENT,
    )
    ids = {chunk.id async for chunk in stream}
    await receiver.wait_for(_has_root(CLIENT_TRACE))
    spans = receiver.trace(CLIENT_TRACE)
    root = _root(spans)
    assert root.name == f"chat {MODEL}"
    assert root.parent_span_id == CLIENT_SPAN
    named = _by_name(spans)
    assert set(named) == {root.name, *SPLIT_STREAM_STEPS}
    for span in spans:
        if span is not root:
            assert span.parent_span_id == root.span_id, span.name
            assert root.start_ns <= span.start_ns <= span.end_ns <= root.end_ns, span.name
    attributes = root.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.response.model"] == MODEL
    assert {attributes["gen_ai.response.id"]} == ids
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.usage.output_tokens"] == 8
    assert attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["tandem.path"] == "disaggregated"
    assert attributes["tandem.outcome"] == "finished"
    assert attributes["tandem.tenant.id"]
    assert attributes["tandem.kv.blocks"] >= 1
    assert root.status_code != ERROR

    (prefill,) = named["tandem.prefill"]
    (decode,) = named["tandem.decode"]
    assert prefill.kind == decode.kind == CLIENT
    assert decode.events == ("first_token",)
    assert decode.attributes["tandem.stream.chunks"] >= 8
    assert named["tandem.admission.queue"][0].attributes["tandem.queue.wait_s"] >= 0
    # Each leg carried its own span as the parent of whatever the worker records.
    sent = {r["path"]: r["headers"].get("traceparent") for r in stack.decode.stats.requests}
    assert sent["/v1/chat/completions"] == f"00-{CLIENT_TRACE}-{decode.span_id}-01"
    sent = {r["path"]: r["headers"].get("traceparent") for r in stack.prefill.stats.requests}
    assert sent["/v1/chat/completions"] == f"00-{CLIENT_TRACE}-{prefill.span_id}-01"


async def test_no_api_key_and_no_text_in_any_span(stack: FakeStack, receiver: OtlpReceiver) -> None:
    secret_prompt = "my-secret-prompt-words"
    answer = await stack.client.completions.create(
        model=MODEL, prompt=secret_prompt, max_tokens=4, extra_headers=TRACEPARENT
    )
    await receiver.wait_for(_has_root(CLIENT_TRACE))
    root = _root(receiver.trace(CLIENT_TRACE))
    assert root.name == f"text_completion {MODEL}"
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.response.id"] == answer.id
    output = answer.choices[0].text
    assert stack.api_key
    for span in receiver.spans:
        for value in (*span.attributes.values(), *span.resource.values()):
            text = str(value)
            assert stack.api_key not in text and ADMIN_KEY not in text, span.name
            assert secret_prompt not in text and output not in text, span.name


async def test_a_failed_prefill_leg_shows_why_the_request_went_colocated(
    stack: FakeStack, receiver: OtlpReceiver
) -> None:
    stack.prefill.fail_status = 500
    await stack.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_headers=TRACEPARENT,
    )
    await receiver.wait_for(_has_root(CLIENT_TRACE))
    named = _by_name(receiver.trace(CLIENT_TRACE))
    (prefill,) = named["tandem.prefill"]
    assert prefill.status_code == ERROR
    assert prefill.attributes["tandem.fallback.reason"] == "prefill_failed"
    assert prefill.attributes["error.type"]
    root = named[f"chat {MODEL}"][0]
    assert root.attributes["tandem.path"] == "fallback"
    assert root.attributes["tandem.outcome"] == "finished"
    assert "tandem.kv_transfer" not in named  # nothing was handed off


async def test_a_re_run_decode_leg_is_its_own_span_with_its_reason(
    stack: FakeStack, receiver: OtlpReceiver
) -> None:
    stack.decode.fail_status, stack.decode.fail_times = 500, 1
    await stack.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        extra_headers=TRACEPARENT,
    )
    await receiver.wait_for(_has_root(CLIENT_TRACE))
    failed, rerun = sorted(_by_name(receiver.trace(CLIENT_TRACE))["tandem.decode"],
                           key=lambda s: s.start_ns)  # fmt: skip
    assert failed.status_code == ERROR
    assert failed.attributes["tandem.fallback.reason"] == "decode_failed"
    assert rerun.attributes["tandem.retry.reason"] == "decode_failed"
    assert rerun.status_code != ERROR


async def test_a_refused_request_ends_its_trace_with_the_error_type(
    stack: FakeStack, receiver: OtlpReceiver
) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            headers={**TRACEPARENT, "Authorization": "Bearer not-a-key"},
        )
    assert response.status_code == 401
    await receiver.wait_for(_has_root(CLIENT_TRACE))
    named = _by_name(receiver.trace(CLIENT_TRACE))
    root = named["chat"][0]  # never resolved a model
    assert root.attributes["error.type"] == response.json()["error"]["code"]
    assert root.status_code != ERROR  # a client error, as on HTTP server spans
    assert named["tandem.authenticate"][0].attributes["error.type"]


async def test_an_idempotent_replay_is_traced_as_one(
    stack: FakeStack, receiver: OtlpReceiver
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {**stack.auth_headers, "Idempotency-Key": "trace-me"}
    async with httpx.AsyncClient(base_url=stack.base_url, headers=headers) as http:
        first = await http.post("/v1/chat/completions", json=body)
        replayed = await http.post("/v1/chat/completions", json=body, headers=TRACEPARENT)
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert first.json() == replayed.json()
    await receiver.wait_for(_has_root(CLIENT_TRACE))
    named = _by_name(receiver.trace(CLIENT_TRACE))
    assert named["tandem.idempotency"][0].attributes["tandem.idempotency.outcome"] == "replayed"
    assert "tandem.decode" not in named


async def test_parent_based_sampling_follows_the_client_and_samples_the_rest(
    receiver: OtlpReceiver,
) -> None:
    async for stack in _stack(receiver, sample_ratio=0.0):
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
        await stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        await stack.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_headers=TRACEPARENT
        )
        await receiver.wait_for(_has_root(CLIENT_TRACE))
        unsampled = f"00-{CLIENT_TRACE[::-1]}-{CLIENT_SPAN}-00"
        await stack.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_headers={"traceparent": unsampled}
        )
        sent = [r["headers"].get("traceparent") for r in stack.decode.stats.requests]
    # Only the request whose client sampled it was traced, and nothing else was exported.
    assert {s.trace_id for s in receiver.spans} == {CLIENT_TRACE}
    # Every decision travels on to the worker, which follows it instead of tracing alone.
    sampled = [int(header.rsplit("-", 1)[1], 16) & 1 for header in sent if header]
    assert sampled == [0, 1, 0]


async def test_with_tracing_off_no_span_and_no_header_goes_anywhere(
    receiver: OtlpReceiver,
) -> None:
    async with make_fake_stack() as stack:
        await stack.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_headers=TRACEPARENT,
        )
        sent = [r["headers"] for r in stack.decode.stats.requests]
    assert sent and all("traceparent" not in headers for headers in sent)
    assert receiver.num_exports == 0


async def test_the_latency_histograms_and_the_log_line_carry_the_trace_id(
    stack: FakeStack, receiver: OtlpReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.requests")
    await stack.client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        extra_headers=TRACEPARENT,
    )
    openmetrics = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        text = (await http.get("/metrics", headers=openmetrics)).text
    for histogram in ("time_to_first_token", "request_duration", "time_per_output_token"):
        lines = [line for line in text.splitlines()
                 if line.startswith(f"gen_ai_server_{histogram}_seconds_bucket")]  # fmt: skip
        assert any(f'# {{trace_id="{CLIENT_TRACE}"}}' in line for line in lines), histogram
    ended = [r.getMessage() for r in caplog.records if " finished trace=" in r.getMessage()]
    assert any(f"trace={CLIENT_TRACE}" in message for message in ended), ended
