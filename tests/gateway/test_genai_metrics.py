"""The OpenTelemetry GenAI server metrics on ``/metrics``: their labels and buckets, the tenant
label's bound, exemplars (OpenMetrics only), content negotiation, and the counters the rollout
gates' Prometheus provider reads."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_classic
from prometheus_client.samples import Sample

from core.messages import Endpoint, ServingPath, Usage
from core.models import ServedModel
from core.moderation import Action, Category, ModerationDecision, Stage
from core.request import Request, RequestPhase
from gateway.auth import ANONYMOUS
from gateway.metrics import OPENMETRICS_CONTENT_TYPE, GatewayMetrics, wants_openmetrics
from tests.gateway.conftest import MODEL, FakeStack

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)

TTFT = "gen_ai_server_time_to_first_token_seconds"
TPOT = "gen_ai_server_time_per_output_token_seconds"
DURATION = "gen_ai_server_request_duration_seconds"
TOKENS = "gen_ai_server_token_usage"
BUCKETS = {
    TTFT: [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10],
    TPOT: [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5],
    DURATION: [0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96,
               81.92],
    TOKENS: [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216,
             67108864],
}  # fmt: skip

Labels = frozenset[tuple[str, str]]


def _by_labels(samples: Iterable[Sample], name: str) -> dict[Labels, float]:
    return {frozenset(s.labels.items()): s.value for s in samples if s.name == name}


def _samples(text: str | bytes, *, openmetrics: bool = False) -> list[Sample]:
    """Every sample of an exposition, through its format's parser (the OpenMetrics one raises
    on a document that is not valid OpenMetrics: no ``# EOF``, a counter without ``_total``)."""
    if isinstance(text, bytes):
        text = text.decode()
    parse: Callable[[str], Iterable[Metric]] = parse_openmetrics if openmetrics else parse_classic
    return [sample for family in parse(text) for sample in family.samples]


def _labels(**labels: str) -> Labels:
    return frozenset(labels.items())


def _genai(operation: str, tenant: str, path: str = "disaggregated", **more: str) -> Labels:
    return _labels(
        gen_ai_operation_name=operation, gen_ai_request_model=MODEL, tandem_version=MODEL,
        tandem_path=path, tandem_tenant=tenant, **more,
    )  # fmt: skip


def _bucket_bounds(samples: list[Sample], name: str, labels: Labels) -> list[float]:
    """The ``le`` bounds of one histogram series, +Inf left out, in exposition order."""
    bounds = [
        float(s.labels["le"])
        for s in samples
        if s.name == f"{name}_bucket"
        and frozenset((k, v) for k, v in s.labels.items() if k != "le") == labels
    ]
    assert bounds[-1] == float("inf")
    return bounds[:-1]


async def _scrape(stack: FakeStack, accept: str | None = None) -> httpx.Response:
    headers = {"Accept": accept} if accept is not None else {}
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        response = await http.get("/metrics", headers=headers)
    assert response.status_code == 200
    return response


async def _tenant_id(stack: FakeStack, name: str) -> str:
    response = await stack.admin.get(f"/admin/v1/tenants/{name}")
    assert response.status_code == 200, response.text
    return str(response.json()["tenant_id"])


async def test_a_stream_and_a_completion_in_the_genai_histograms(fake_stack: FakeStack) -> None:
    tenant = await _tenant_id(fake_stack, "default")
    stream = await fake_stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chat_usage, chat_finish = None, None
    async for chunk in stream:
        if chunk.usage is not None:
            chat_usage = chunk.usage
        if chunk.choices and chunk.choices[0].finish_reason is not None:
            chat_finish = chunk.choices[0].finish_reason
    assert chat_usage is not None and chat_usage.completion_tokens == 4
    completion = await fake_stack.client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 3

    samples = _samples((await _scrape(fake_stack)).text)
    chat, text = _genai("chat", tenant), _genai("text_completion", tenant)
    assert _by_labels(samples, f"{TTFT}_count") == {chat: 1.0, text: 1.0}
    # Only a stream has tokens spaced in time: the non-streamed completion has no TPOT.
    assert _by_labels(samples, f"{TPOT}_count") == {chat: 1.0}
    ended = {"tandem_outcome": "finished", "error_type": ""}
    assert _by_labels(samples, f"{DURATION}_count") == {
        _genai("chat", tenant, **ended): 1.0,
        _genai("text_completion", tenant, **ended): 1.0,
    }
    assert _by_labels(samples, f"{TOKENS}_sum") == {
        _genai("chat", tenant, gen_ai_token_type="input"): float(chat_usage.prompt_tokens),
        _genai("chat", tenant, gen_ai_token_type="output"): 4.0,
        _genai("text_completion", tenant, gen_ai_token_type="input"): float(
            completion.usage.prompt_tokens
        ),
        _genai("text_completion", tenant, gen_ai_token_type="output"): 3.0,
    }
    assert _bucket_bounds(samples, TTFT, chat) == BUCKETS[TTFT]
    assert _bucket_bounds(samples, TPOT, chat) == BUCKETS[TPOT]
    assert _bucket_bounds(samples, DURATION, _genai("chat", tenant, **ended)) == BUCKETS[DURATION]
    output = _genai("text_completion", tenant, gen_ai_token_type="output")
    assert _bucket_bounds(samples, TOKENS, output) == BUCKETS[TOKENS]
    # 3 output tokens: above the bucket at 1, inside the one at 4.
    buckets = _by_labels(samples, f"{TOKENS}_bucket")
    assert buckets[output | {("le", "1.0")}] == 0.0
    assert buckets[output | {("le", "4.0")}] == 1.0

    finishes = collections.Counter([chat_finish, completion.choices[0].finish_reason])
    assert _by_labels(samples, "tandem_finish_reasons_total") == {
        _labels(model=MODEL, version=MODEL, finish_reason=str(reason)): float(count)
        for reason, count in finishes.items()
    }
    # Tandem's own series are still there, as before.
    assert _by_labels(samples, "tandem_requests_total") == {
        _labels(path="disaggregated", reason="long_prompt", outcome="finished", model=MODEL,
                version=MODEL): 2.0,
    }  # fmt: skip


async def test_metrics_answer_openmetrics_when_the_scrape_asks(fake_stack: FakeStack) -> None:
    await fake_stack.client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    worker_series = "tandem_worker_prefix_cache_queries_total"
    prefill = _labels(worker="prefill-ext-0", role="prefill")

    for accept in ("application/openmetrics-text; version=1.0.0", PROMETHEUS_ACCEPT):
        response = await _scrape(fake_stack, accept)
        assert response.headers["content-type"] == OPENMETRICS_CONTENT_TYPE
        assert response.text.endswith("# EOF\n")
        samples = _samples(response.text, openmetrics=True)  # raises on an invalid document
        assert _by_labels(samples, f"{TTFT}_count") == {
            _genai("chat", await _tenant_id(fake_stack, "default")): 1.0
        }
        # The workers' re-exported counters made it into the same valid document.
        assert _by_labels(samples, worker_series)[prefill] >= 1.0
        transfers = _by_labels(samples, "tandem_worker_kv_transfers_total")
        assert transfers[_labels(worker="decode-ext-0", role="decode")] == 1.0

    classic = await _scrape(fake_stack)
    assert classic.headers["content-type"].startswith("text/plain; version=1.0.0")
    assert "# EOF" not in classic.text
    classic_samples = _samples(classic.text)
    assert _by_labels(classic_samples, worker_series)[prefill] >= 1.0
    # The workers' text is appended as the re-export writes it (label order included).
    assert f'{worker_series}{{worker="prefill-ext-0",role="prefill"}}' in classic.text


# -- GatewayMetrics on its own ---------------------------------------------------------------

SERVED = ServedModel("m", 256, 0, version="m@0123abcd")


def _ended(
    *,
    tenant_id: str | None = "ten_a",
    endpoint: Endpoint = Endpoint.CHAT,
    end: RequestPhase = RequestPhase.FINISHED,
    error_code: str | None = None,
    finish_reason: str | None = "stop",
    moderation: Action | None = None,
) -> Request:
    """A streamed request with fixed timings: TTFT 0.03 s, 11 tokens 0.03 s apart after the
    first (TPOT 0.03 s), 0.33 s end to end."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    if endpoint is Endpoint.COMPLETIONS:
        body = {"model": "m", "stream": True, "prompt": "hi"}
    request = Request.receive("r1", endpoint, SERVED, body, tenant_id=tenant_id)
    request.path = ServingPath.COLOCATED
    if moderation is not None:
        request.record_moderation(
            [ModerationDecision(Stage.OUTPUT, "rules", Category.HATE, moderation)]
        )
    request.advance(RequestPhase.DECODING)
    request.count_output(11)
    if end is RequestPhase.FINISHED:
        request.finish(finish_reason, Usage(prompt_tokens=20, completion_tokens=11))
    elif end is RequestPhase.FAILED:
        request.fail(error_code)
    else:
        request.abort()
    request.started_at = 100.0
    request.first_token_at = 100.03
    request.finished_at = 100.33
    return request


def _unit_labels(tenant: str = "ten_a", operation: str = "chat", **more: str) -> Labels:
    return _labels(
        gen_ai_operation_name=operation, gen_ai_request_model="m",
        tandem_version="m@0123abcd", tandem_path="colocated", tandem_tenant=tenant, **more,
    )  # fmt: skip


def test_exemplars_carry_the_trace_id_in_openmetrics_only() -> None:
    metrics = GatewayMetrics([])
    metrics.observe_end(_ended(), "standard", trace_id=TRACE_ID)
    metrics.observe_end(_ended(tenant_id="ten_b"), "standard")  # no trace: no exemplar

    samples = _samples(metrics.render_openmetrics(), openmetrics=True)
    with_exemplar = {
        (s.name, s.labels["le"], s.labels["tandem_tenant"]): s.exemplar
        for s in samples
        if s.exemplar is not None
    }
    # The bucket each value fell in: TTFT 0.03 -> 0.04, TPOT 0.03 -> 0.05, E2E 0.33 -> 0.64.
    assert set(with_exemplar) == {
        (f"{TTFT}_bucket", "0.04", "ten_a"),
        (f"{TPOT}_bucket", "0.05", "ten_a"),
        (f"{DURATION}_bucket", "0.64", "ten_a"),
    }
    for exemplar in with_exemplar.values():
        assert exemplar.labels == {"trace_id": TRACE_ID}
    assert with_exemplar[(f"{TTFT}_bucket", "0.04", "ten_a")].value == pytest.approx(0.03)

    classic = metrics.render().decode()
    assert TRACE_ID not in classic
    assert _by_labels(_samples(classic), f"{TTFT}_count") == {
        _unit_labels(): 1.0,
        _unit_labels("ten_b"): 1.0,
    }


def test_request_duration_says_how_it_ended() -> None:
    metrics = GatewayMetrics([])
    metrics.observe_end(_ended(), "standard")
    metrics.observe_end(_ended(end=RequestPhase.FAILED, error_code="engine_error"), "standard")
    metrics.observe_end(_ended(end=RequestPhase.FAILED), "standard")  # an engine 400: no code
    metrics.observe_end(_ended(end=RequestPhase.ABORTED), "standard")
    metrics.observe_end(_ended(endpoint=Endpoint.COMPLETIONS), "standard")

    samples = _samples(metrics.render().decode())
    assert _by_labels(samples, f"{DURATION}_count") == {
        _unit_labels(tandem_outcome="finished", error_type=""): 1.0,
        _unit_labels(tandem_outcome="failed", error_type="engine_error"): 1.0,
        _unit_labels(tandem_outcome="failed", error_type="_OTHER"): 1.0,
        _unit_labels(tandem_outcome="aborted", error_type=""): 1.0,
        _unit_labels(operation="text_completion", tandem_outcome="finished", error_type=""): 1.0,
    }
    # Usage is the engine's, sent only when it finished.
    assert _by_labels(samples, f"{TOKENS}_sum") == {
        _unit_labels(gen_ai_token_type="input"): 20.0,
        _unit_labels(gen_ai_token_type="output"): 11.0,
        _unit_labels(operation="text_completion", gen_ai_token_type="input"): 20.0,
        _unit_labels(operation="text_completion", gen_ai_token_type="output"): 11.0,
    }


def test_the_tenant_label_is_bounded() -> None:
    metrics = GatewayMetrics([], max_tenant_labels=2)
    for tenant in ("ten_a", "ten_b", "ten_c", "ten_a", "ten_d", None, ANONYMOUS.tenant_id):
        metrics.observe_end(_ended(tenant_id=tenant), "standard")

    samples = _samples(metrics.render().decode())
    assert _by_labels(samples, f"{TTFT}_count") == {
        _unit_labels("ten_a"): 2.0,  # the first two tenants seen keep their own value...
        _unit_labels("ten_b"): 1.0,
        _unit_labels("other"): 2.0,  # ...later ones share one
        _unit_labels("none"): 2.0,  # no tenant, or the anonymous one (auth off)
    }
    with pytest.raises(ValueError, match="max_tenant_labels"):
        GatewayMetrics([], max_tenant_labels=-1)


def test_finish_reasons_and_moderation_blocks_per_version() -> None:
    metrics = GatewayMetrics([])
    metrics.observe_end(_ended(finish_reason="stop"), "standard")
    metrics.observe_end(_ended(finish_reason="stop"), "standard")
    metrics.observe_end(_ended(finish_reason="length"), "standard")
    metrics.observe_end(_ended(finish_reason=None), "standard")
    blocked = _ended(finish_reason="content_filter", moderation=Action.BLOCK)
    metrics.observe_end(blocked, "standard")
    metrics.observe_end(_ended(moderation=Action.FLAG), "standard")  # flagged: not blocked
    metrics.observe_end(_ended(end=RequestPhase.FAILED, error_code="engine_error"), "standard")

    samples = _samples(metrics.render().decode())
    version = {"model": "m", "version": "m@0123abcd"}
    assert _by_labels(samples, "tandem_finish_reasons_total") == {
        _labels(**version, finish_reason="stop"): 3.0,  # the flagged one finished with stop too
        _labels(**version, finish_reason="length"): 1.0,
        _labels(**version, finish_reason="none"): 1.0,
        _labels(**version, finish_reason="content_filter"): 1.0,
    }
    assert _by_labels(samples, "tandem_moderation_blocked_requests_total") == {
        _labels(**version): 1.0
    }


def test_openmetrics_rendering_keeps_appended_worker_text_valid() -> None:
    workers = (
        "# HELP tandem_worker_preemptions_total Preempted.\n"
        "# TYPE tandem_worker_preemptions_total counter\n"
        'tandem_worker_preemptions_total{worker="decode-0",role="decode"} 3.0\n'
        "# HELP tandem_worker_kv_cache_usage_ratio Usage.\n"
        "# TYPE tandem_worker_kv_cache_usage_ratio gauge\n"
        'tandem_worker_kv_cache_usage_ratio{worker="decode-0",role="decode"} 0.25\n'
    )
    metrics = GatewayMetrics([])
    body, content_type = metrics.expose("application/openmetrics-text", workers)
    assert content_type == OPENMETRICS_CONTENT_TYPE
    parsed = parse_openmetrics(body.decode())  # type: ignore[no-untyped-call]
    families = {f.name: f for f in parsed}
    assert families["tandem_worker_preemptions"].type == "counter"
    assert families["tandem_worker_preemptions"].samples[0].value == 3.0
    assert families["tandem_worker_kv_cache_usage_ratio"].samples[0].value == 0.25

    body, content_type = metrics.expose(None, workers)
    assert content_type.startswith("text/plain")
    assert body == metrics.render() + workers.encode()


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (PROMETHEUS_ACCEPT, True),
        ("application/openmetrics-text", True),
        ("Application/OpenMetrics-Text; Version=1.0.0", True),
        ("text/plain;version=0.0.4;q=0.5,*/*;q=0.1", False),
        ("application/openmetrics-text;q=0,text/plain", False),
        ("application/openmetrics-text;q=oops", False),
        ("*/*", False),
        ("", False),
        (None, False),
    ],
)
def test_which_scrapes_get_openmetrics(accept: str | None, expected: bool) -> None:
    assert wants_openmetrics(accept) is expected
