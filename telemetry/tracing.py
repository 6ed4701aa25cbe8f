"""Tracing configuration from the standard ``OTEL_*`` environment, and the span pipeline.

Tracing is off unless an OTLP endpoint is configured (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
or ``OTEL_EXPORTER_OTLP_ENDPOINT``); ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``
turn it off again. Off, every request shares one inert ``RequestTrace``: no span, no allocation.

- Protocol: ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` / ``OTEL_EXPORTER_OTLP_PROTOCOL``,
  ``http/protobuf`` (the OTLP default) or ``grpc``. With the generic endpoint and HTTP, spans go
  to ``<endpoint>/v1/traces`` as the OTLP exporter specification says.
- Sampling: parent-based ratio (``parentbased_traceidratio``) with ``OTEL_TRACES_SAMPLER_ARG``
  (default 1.0): a client's sampled ``traceparent`` is always followed, a root is kept with
  that probability. ``OTEL_TRACES_SAMPLER`` picks another of ``SAMPLERS``.
- The SDK reads the rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, the exporter's
  headers and timeouts, ``OTEL_BSP_*`` batch sizes and delay).

vLLM workers export their own ``llm_request`` span to the same endpoint: the supervisor starts
them with ``--otlp-traces-endpoint`` and the protocol made explicit (vLLM defaults to gRPC;
``workers/process.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    TraceIdRatioBased,
)
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from telemetry.otlp_env import Protocol, TelemetryConfigError, gateway_resource, otlp_target
from telemetry.request_trace import NO_TRACE, RequestTrace, TraceSink

_SCOPE = "tandem.gateway"
SAMPLERS = (
    "parentbased_traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "traceidratio",
    "always_on",
    "always_off",
)
"""The SDK's samplers ``OTEL_TRACES_SAMPLER`` may name (the default first)."""


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Where spans go; ``traces_endpoint`` None means tracing is off."""

    traces_endpoint: str | None = None
    """The full OTLP traces URL (HTTP) or ``host:port`` / URL (gRPC)."""
    protocol: Protocol = "http/protobuf"
    sampler: str = "parentbased_traceidratio"
    """``OTEL_TRACES_SAMPLER``: one of ``SAMPLERS``."""
    sample_ratio: float = 1.0
    """``OTEL_TRACES_SAMPLER_ARG``: the share of roots kept by the ``traceidratio`` samplers."""

    def build_sampler(self) -> Sampler:
        root: Sampler = {"always_on": ALWAYS_ON, "always_off": ALWAYS_OFF}.get(
            self.sampler.removeprefix("parentbased_"), TraceIdRatioBased(self.sample_ratio)
        )
        return ParentBased(root) if self.sampler.startswith("parentbased_") else root

    @property
    def enabled(self) -> bool:
        return self.traces_endpoint is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if environ is None else environ
        target = otlp_target(env, "traces")
        if target is None:
            return cls()
        sampler = env.get("OTEL_TRACES_SAMPLER", "").strip() or "parentbased_traceidratio"
        if sampler not in SAMPLERS:
            raise TelemetryConfigError(
                f"OTEL_TRACES_SAMPLER={sampler!r} is not supported: use one of "
                + ", ".join(SAMPLERS)
            )
        raw = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip() or "1.0"
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise TelemetryConfigError(
                f"OTEL_TRACES_SAMPLER_ARG={raw!r}: give the share of requests to trace, "
                "between 0 and 1"
            )
        return cls(target.endpoint, target.protocol, sampler, ratio)


class Tracing:
    """The gateway's span pipeline (sampler, batching exporter thread) and request traces.

    No SDK ``TracerProvider``: a request's spans are built whole when it ends and handed to
    the SDK's ``BatchSpanProcessor`` (telemetry/request_trace.py says why)."""

    def __init__(self, config: TracingConfig, exporter: SpanExporter | None = None) -> None:
        """``exporter`` replaces the OTLP one (tests, benchmarks)."""
        self.config = config
        self._sink: TraceSink | None = None
        if config.enabled or exporter is not None:
            resource = _HashedOnce(gateway_resource())
            self._sink = TraceSink(
                config.build_sampler(),
                BatchSpanProcessor(exporter or _exporter(config)),
                resource,
                InstrumentationScope(_SCOPE),
                RandomIdGenerator(),
            )

    @property
    def enabled(self) -> bool:
        return self._sink is not None

    def start(self, headers: Mapping[str, str], operation: str) -> RequestTrace:
        """The trace of a request that just arrived, under the client's ``traceparent``."""
        if self._sink is None:
            return NO_TRACE
        return RequestTrace.start(self._sink, headers, operation)

    async def aclose(self) -> None:
        """Export what is still batched, then stop (off the loop: it blocks on the network)."""
        if self._sink is not None:
            await asyncio.to_thread(self._sink.processor.shutdown)


class _HashedOnce(Resource):
    """The resource, hashed once: the OTLP encoder groups spans by resource and so hashes it
    for every span, and ``Resource.__hash__`` serialises its attributes to JSON each time (a
    sixth of the encoding's CPU)."""

    def __init__(self, resource: Resource) -> None:
        super().__init__(resource.attributes, resource.schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


def _exporter(config: TracingConfig) -> SpanExporter:
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=config.traces_endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.traces_endpoint)
