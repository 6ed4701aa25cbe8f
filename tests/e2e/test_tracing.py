"""One disaggregated streaming request on the real stack is one trace: the gateway's spans for
every phase, and vLLM's own ``llm_request`` spans from both workers joined under the legs that
called them. Exported over OTLP/HTTP (protobuf) to a receiver in this process
(tests/otlp_receiver.py) that decodes them with the OpenTelemetry proto package."""

from __future__ import annotations

import secrets

import pytest

from tests.e2e.conftest import ADMIN_KEY, LiveStack, traced_stream
from tests.otlp_receiver import SPLIT_STREAM_STEPS, OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.e2e

SERVER = 2  # the proto's SpanKind


def _complete(spans: list[ReceivedSpan], trace_id: str) -> bool:
    mine = [s for s in spans if s.trace_id == trace_id]
    roots = [s for s in mine if s.kind == SERVER and s.service == "tandem-gateway"]
    return bool(roots) and sum(s.service == "tandem-vllm" for s in mine) >= 2


def test_a_disaggregated_stream_is_one_trace_with_the_workers_spans_joined(
    live_stack: LiveStack, otlp_receiver: OtlpReceiver
) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    ids = traced_stream(live_stack, trace_id, client_span)

    spans = otlp_receiver.wait_for_sync(lambda spans: _complete(spans, trace_id), timeout_s=30)
    mine = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in mine}
    gateway = [s for s in mine if s.service == "tandem-gateway"]
    [root] = [s for s in gateway if s.kind == SERVER]
    assert root.parent_span_id == client_span
    assert root.name == f"chat {live_stack.model}"
    assert {root.attributes["gen_ai.response.id"]} == ids
    assert root.attributes["gen_ai.response.model"] == live_stack.version
    assert root.attributes["tandem.path"] == "disaggregated"
    assert root.attributes["gen_ai.usage.output_tokens"] == 8
    names = {s.name for s in gateway}
    assert names >= SPLIT_STREAM_STEPS
    for span in gateway:
        if span is not root:
            assert span.parent_span_id == root.span_id, span.name

    # vLLM's spans: one per leg, each the child of the leg that called its worker.
    workers = [s for s in mine if s.service == "tandem-vllm"]
    parents = {by_id[s.parent_span_id].name: s for s in workers if s.parent_span_id in by_id}
    assert set(parents) == {"tandem.prefill", "tandem.decode"}, [
        (s.name, s.parent_span_id) for s in workers
    ]
    assert parents["tandem.prefill"].resource["tandem.role"] == "prefill"
    assert parents["tandem.decode"].resource["tandem.role"] == "decode"
    decode_span = parents["tandem.decode"]
    assert decode_span.attributes["gen_ai.usage.completion_tokens"] == 8

    for span in otlp_receiver.spans:  # every span exported this session
        for value in (*span.attributes.values(), *span.resource.values()):
            assert live_stack.api_key not in str(value) and ADMIN_KEY not in str(value)
