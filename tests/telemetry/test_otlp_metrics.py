"""The GenAI metrics pushed over OTLP/HTTP by the gateway over fake engines, decoded from
protobuf by the test receiver (tests/otlp_receiver.py); and their configuration."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from telemetry.otlp_env import TelemetryConfigError
from telemetry.otlp_metrics import (
    DURATION_BUCKETS_S,
    TOKEN_BUCKETS,
    TTFT_BUCKETS_S,
    OtlpMetricsConfig,
)
from tests.gateway.conftest import MODEL, make_fake_stack
from tests.otlp_receiver import OtlpReceiver, ReceivedPoint


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = await OtlpReceiver().start()
    yield receiver
    await receiver.aclose()


def _last(points: list[ReceivedPoint], metric: str, **attributes: object) -> ReceivedPoint:
    """The latest cumulative point of ``metric`` whose attributes include ``attributes``."""
    matching = [
        p for p in points
        if p.metric == metric and all(p.attributes.get(k) == v for k, v in attributes.items())
    ]  # fmt: skip
    assert matching, f"no {metric} point with {attributes}: {sorted({p.metric for p in points})}"
    return matching[-1]


async def test_the_genai_instruments_reach_a_collector_over_otlp(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "100")  # ms
    config = OtlpMetricsConfig(endpoint=receiver.metrics_url)
    async with make_fake_stack(gateway={"otlp_metrics": config}) as stack:
        stream = await stack.client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None][-1]
        await receiver.wait_for(lambda _: any(p.count for p in receiver.points))
    # The gateway's shutdown pushed the last figures; every instrument has its data point.
    common = {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "tandem.model.version": MODEL,
        "tandem.path": "disaggregated",
    }
    points = receiver.points
    ttft = _last(points, "gen_ai.server.time_to_first_token", **common)
    assert (ttft.unit, ttft.count, ttft.bounds) == ("s", 1, TTFT_BUCKETS_S)
    assert ttft.attributes["tandem.tenant"].startswith("ten_")
    assert _last(points, "gen_ai.server.time_per_output_token", **common).count == 1
    duration = _last(points, "gen_ai.server.request.duration", **common)
    assert (duration.count, duration.bounds) == (1, DURATION_BUCKETS_S)
    assert duration.attributes["tandem.outcome"] == "finished"
    assert "error.type" not in duration.attributes
    tokens = _last(points, "gen_ai.server.token.usage", **common, **{"gen_ai.token.type": "output"})
    assert (tokens.unit, tokens.sum, tokens.bounds) == ("{token}", 8, TOKEN_BUCKETS)
    prompt = _last(points, "gen_ai.server.token.usage", **{"gen_ai.token.type": "input"})
    assert prompt.sum == usage.prompt_tokens


def test_configured_by_the_standard_variables() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}
    assert not OtlpMetricsConfig.from_env({}).enabled
    assert OtlpMetricsConfig.from_env(base).endpoint == "http://collector:4318/v1/metrics"
    assert not OtlpMetricsConfig.from_env({**base, "OTEL_METRICS_EXPORTER": "none"}).enabled
    own = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://m:1/x"}
    assert OtlpMetricsConfig.from_env(own).endpoint == "http://m:1/x"
    with pytest.raises(TelemetryConfigError, match="OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"):
        OtlpMetricsConfig.from_env({**base, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
