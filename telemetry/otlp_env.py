"""Where an OTLP signal goes, read from the OpenTelemetry exporter environment variables the
same way for traces and metrics (the OTLP exporter specification's rules), and the resource
both carry."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from opentelemetry.sdk.resources import Resource

Protocol = Literal["http/protobuf", "grpc"]
DEFAULT_SERVICE_NAME = "tandem-gateway"
Signal = Literal["traces", "metrics"]


class TelemetryConfigError(ValueError):
    """An ``OTEL_*`` variable Tandem cannot use; the message names it and the accepted values."""


@dataclass(frozen=True, slots=True)
class OtlpTarget:
    endpoint: str
    """The full URL (HTTP: ``.../v1/<signal>``) or the gRPC endpoint."""
    protocol: Protocol


def otlp_target(env: Mapping[str, str], signal: Signal) -> OtlpTarget | None:
    """The collector for ``signal``, or None when it is not exported: no endpoint, or
    ``OTEL_SDK_DISABLED=true``, or ``OTEL_<SIGNAL>_EXPORTER=none``."""
    upper = signal.upper()
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if env.get(f"OTEL_{upper}_EXPORTER", "otlp").strip().lower() == "none":
        return None
    protocol = (
        env.get(f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in ("http/protobuf", "grpc"):
        raise TelemetryConfigError(
            f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL={protocol!r} is not supported: use "
            "http/protobuf or grpc"
        )
    endpoint = env.get(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT", "").strip() or None
    if endpoint is None and (base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()):
        endpoint = base if protocol == "grpc" else f"{base.rstrip('/')}/v1/{signal}"
    if endpoint is None:
        return None
    return OtlpTarget(endpoint, "grpc" if protocol == "grpc" else "http/protobuf")


def gateway_resource() -> Resource:
    """What the gateway's spans and metrics say they come from: ``OTEL_SERVICE_NAME`` (else
    ``tandem-gateway``) and whatever ``OTEL_RESOURCE_ATTRIBUTES`` adds (the SDK reads it)."""
    return Resource.create(
        {"service.name": os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME}
    )
