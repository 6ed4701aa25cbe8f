"""Telemetry the gateway exports by the OpenTelemetry standard, to any collector.

``tracing``: the ``OTEL_*`` trace configuration and the span pipeline; ``request_trace``: one
request's span tree, from the gateway into its workers; ``otlp_metrics``: the GenAI metrics
over OTLP (docs/ARCHITECTURE.md, "Observability").
"""
