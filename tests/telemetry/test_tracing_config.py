"""Tracing's configuration from the standard OTEL_* environment (telemetry/tracing.py)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.sampling import Decision

from telemetry.otlp_env import TelemetryConfigError
from telemetry.tracing import SAMPLERS, TracingConfig

ENDPOINT = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}


def test_off_without_an_endpoint_or_when_disabled() -> None:
    assert not TracingConfig.from_env({}).enabled
    assert not TracingConfig.from_env({**ENDPOINT, "OTEL_SDK_DISABLED": "true"}).enabled
    assert not TracingConfig.from_env({**ENDPOINT, "OTEL_TRACES_EXPORTER": "none"}).enabled


def test_the_traces_endpoint_follows_the_otlp_exporter_rules() -> None:
    # HTTP: the generic endpoint gets the signal's path; the traces one is used as given.
    assert TracingConfig.from_env(ENDPOINT).traces_endpoint == "http://collector:4318/v1/traces"
    given = {**ENDPOINT, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:9999/x"}
    assert TracingConfig.from_env(given).traces_endpoint == "http://other:9999/x"
    grpc = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    config = TracingConfig.from_env(grpc)
    assert (config.traces_endpoint, config.protocol) == ("http://c:4317", "grpc")


def test_defaults_to_parent_based_ratio_sampling_of_every_request() -> None:
    config = TracingConfig.from_env(ENDPOINT)
    assert (config.sampler, config.sample_ratio) == ("parentbased_traceidratio", 1.0)
    ratio = TracingConfig.from_env({**ENDPOINT, "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert ratio.sample_ratio == 0.25


@pytest.mark.parametrize("name", SAMPLERS)
def test_every_named_sampler_builds(name: str) -> None:
    config = TracingConfig.from_env({**ENDPOINT, "OTEL_TRACES_SAMPLER": name})
    result = config.build_sampler().should_sample(None, 1 << 64, "chat", attributes={})
    expected = Decision.DROP if name.endswith("always_off") else Decision.RECORD_AND_SAMPLE
    assert result.decision == expected


@pytest.mark.parametrize(
    ("variables", "names"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
        ({"OTEL_TRACES_SAMPLER_ARG": "1.5"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "OTEL_TRACES_SAMPLER_ARG"),
        ({"OTEL_TRACES_SAMPLER": "jaeger_remote"}, "OTEL_TRACES_SAMPLER"),
    ],
)
def test_a_setting_tandem_cannot_use_is_an_error_naming_it(
    variables: dict[str, str], names: str
) -> None:
    with pytest.raises(TelemetryConfigError, match=names):
        TracingConfig.from_env({**ENDPOINT, **variables})
