"""The GenAI server metrics over OTLP, for a collector that takes metrics by push.

The same four instruments ``/metrics`` serves (gateway/metrics.py), under their OpenTelemetry
names and units, with the conventions' bucket boundaries (the one copy of them both use):

    gen_ai.server.time_to_first_token    s        first output to the client
    gen_ai.server.time_per_output_token  s        streams: mean gap after the first token
    gen_ai.server.request.duration       s        every request that ended
    gen_ai.server.token.usage            {token}  per request, gen_ai.token.type input|output

Attributes: ``gen_ai.operation.name``, ``gen_ai.request.model``, ``tandem.model.version``,
``tandem.path``, ``tandem.tenant`` (the same bounded tenant label); the duration also
``tandem.outcome`` and, when failed, ``error.type``.

On when an OTLP endpoint for metrics is configured (``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``, or
``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/metrics`` over HTTP) and not ``OTEL_METRICS_EXPORTER=
none`` / ``OTEL_SDK_DISABLED=true``; the protocol follows ``OTEL_EXPORTER_OTLP_METRICS_PROTOCOL``
/ ``OTEL_EXPORTER_OTLP_PROTOCOL``, the export period ``OTEL_METRIC_EXPORT_INTERVAL`` (ms, the
SDK's default 60 s). Cumulative temporality, as a Prometheus-backed collector expects.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader

from core.request import Request, RequestPhase
from telemetry.otlp_env import Protocol, gateway_resource, otlp_target
from telemetry.request_trace import operation_name

TTFT_BUCKETS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)  # fmt: skip
TPOT_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS_S = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)  # fmt: skip
TOKEN_BUCKETS = tuple(float(4**power) for power in range(14))  # 1 to 67,108,864
"""The GenAI semantic conventions' bucket advice, instrument by instrument."""
OTHER_ERROR = "_OTHER"
"""``error.type`` of a failure without a code (the conventions' fallback value)."""


@dataclass(frozen=True, slots=True)
class OtlpMetricsConfig:
    """Where the metrics go; ``endpoint`` None means not over OTLP (``/metrics`` only)."""

    endpoint: str | None = None
    protocol: Protocol = "http/protobuf"

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OtlpMetricsConfig:
        target = otlp_target(os.environ if environ is None else environ, "metrics")
        return cls() if target is None else cls(target.endpoint, target.protocol)


class OtlpGenAiMetrics:
    """The GenAI instruments on a meter provider that pushes them every export interval."""

    def __init__(self, config: OtlpMetricsConfig, exporter: MetricExporter | None = None) -> None:
        """``exporter`` replaces the OTLP one (tests)."""
        reader = PeriodicExportingMetricReader(exporter or _exporter(config))
        self._provider = MeterProvider(metric_readers=[reader], resource=gateway_resource())
        meter = self._provider.get_meter("tandem.gateway")
        self._ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S,
        )  # fmt: skip
        self._tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first token.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS_S,
        )  # fmt: skip
        self._duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Generative AI server request duration such as time-to-last byte.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS_S,
        )  # fmt: skip
        self._tokens = meter.create_histogram(
            "gen_ai.server.token.usage", unit="{token}",
            description="Number of input and output tokens used per request.",
            explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
        )  # fmt: skip

    def observe(self, request: Request, path: str, tenant: str) -> None:
        """A request that ended (``tenant``: its bounded label, as on ``/metrics``)."""
        attributes = {
            "gen_ai.operation.name": operation_name(request.endpoint),
            "gen_ai.request.model": request.model.name,
            "tandem.model.version": request.model.version_name,
            "tandem.path": path,
            "tandem.tenant": tenant,
        }
        if request.ttft_s is not None:
            self._ttft.record(request.ttft_s, attributes)
        if request.itl_s is not None:
            self._tpot.record(request.itl_s, attributes)
        if request.e2e_s is not None:
            ended = {**attributes, "tandem.outcome": request.phase.name.lower()}
            if request.phase is RequestPhase.FAILED:
                ended["error.type"] = request.error_code or OTHER_ERROR
            self._duration.record(request.e2e_s, ended)
        if request.usage is not None:
            input_tokens = {**attributes, "gen_ai.token.type": "input"}
            self._tokens.record(request.usage.prompt_tokens, input_tokens)
            output_tokens = {**attributes, "gen_ai.token.type": "output"}
            self._tokens.record(request.usage.completion_tokens, output_tokens)

    async def aclose(self) -> None:
        """Push what was recorded since the last export, then stop (off the loop)."""
        await asyncio.to_thread(self._provider.shutdown)


def _exporter(config: OtlpMetricsConfig) -> MetricExporter:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=config.endpoint)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=config.endpoint)
