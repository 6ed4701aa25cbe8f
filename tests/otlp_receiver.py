"""An OTLP/HTTP receiver for tests: what a collector gets, decoded with the OpenTelemetry
proto package (the same messages a real collector parses).

It accepts ``POST /v1/traces`` and ``POST /v1/metrics`` (``application/x-protobuf``, gzip or
not) from the gateway and from vLLM workers, and keeps every span with its resource's
``service.name``, and every histogram data point.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPLIT_STREAM_STEPS = frozenset(
    {
        "tandem.authenticate",
        "tandem.moderation.input",
        "tandem.admission.queue",
        "tandem.prefill",
        "tandem.kv_transfer",
        "tandem.decode",
        "tandem.billing",
    }
)
"""The gateway's child spans of one disaggregated stream with no moderation of its output
and no idempotency key (telemetry/request_trace.py)."""


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    """The proto's SpanKind: 2 SERVER, 3 CLIENT."""
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: tuple[str, ...]
    status_code: int
    """0 unset, 1 ok, 2 error."""
    start_ns: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class ReceivedPoint:
    """One histogram data point of one export (cumulative: later exports repeat it, grown)."""

    metric: str
    unit: str
    attributes: dict[str, Any]
    count: int
    sum: float
    bounds: tuple[float, ...]
    bucket_counts: tuple[int, ...]


@dataclass
class OtlpReceiver:
    """``url`` is the traces endpoint to configure (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``)."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    points: list[ReceivedPoint] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    """Every export's body as received (decompressed): what leak checks search whole
    (tests/security), attributes of span events and links included."""
    num_exports: int = 0
    _runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/metrics"

    async def start(self) -> OtlpReceiver:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._export)
        app.router.add_post("/v1/metrics", self._export_metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def aclose(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.trace_id == trace_id]

    async def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20.0
    ) -> list[ReceivedSpan]:
        """The spans, once ``predicate`` holds on them (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.spans):
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"spans never matched within {timeout_s} s; got {names}")
            await asyncio.sleep(0.05)
        return self.spans

    def wait_for_sync(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """``wait_for`` from another thread than the receiver's (``receiver_in_thread``)."""
        deadline = time.monotonic() + timeout_s
        while not predicate(list(self.spans)):
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in self.spans})
                raise AssertionError(f"spans never matched within {timeout_s} s; got {names}")
            time.sleep(0.1)
        return list(self.spans)

    async def _export_metrics(self, request: web.Request) -> web.Response:
        message = ExportMetricsServiceRequest()
        self.payloads.append(await _read_body(request))
        message.ParseFromString(self.payloads[-1])
        self.num_exports += 1
        for resource_metrics in message.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.WhichOneof("data") != "histogram":
                        continue
                    for point in metric.histogram.data_points:
                        self.points.append(
                            ReceivedPoint(
                                metric=metric.name,
                                unit=metric.unit,
                                attributes=_attributes(point.attributes),
                                count=point.count,
                                sum=point.sum,
                                bounds=tuple(point.explicit_bounds),
                                bucket_counts=tuple(point.bucket_counts),
                            )
                        )
        return web.Response(
            body=ExportMetricsServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def _export(self, request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        self.payloads.append(await _read_body(request))
        message.ParseFromString(self.payloads[-1])
        self.num_exports += 1
        for resource_spans in message.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes=_attributes(span.attributes),
                            resource=resource,
                            events=tuple(event.name for event in span.events),
                            status_code=span.status.code,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )


async def _read_body(request: web.Request) -> bytes:
    raw = await request.read()
    return gzip.decompress(raw) if request.headers.get("Content-Encoding") == "gzip" else raw


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(item) for item in value.array_value.values)
    if kind is None:
        return None
    return getattr(value, kind)


@contextmanager
def receiver_in_thread() -> Iterator[OtlpReceiver]:
    """A receiver on its own event loop thread, for synchronous tests (the e2e tier)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="otlp-receiver", daemon=True)
    thread.start()
    receiver = asyncio.run_coroutine_threadsafe(OtlpReceiver().start(), loop).result(10)
    try:
        yield receiver
    finally:
        asyncio.run_coroutine_threadsafe(receiver.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _serve_forever(port_file: str) -> None:
    """``python -m tests.otlp_receiver PORT_FILE``: a receiver process (benchmarks send it
    their spans); writes its port to PORT_FILE, runs until SIGTERM/SIGINT, then prints how many
    spans and exports it received."""
    import signal

    receiver = await OtlpReceiver().start()
    Path(port_file).write_text(str(receiver.port))  # noqa: ASYNC240  # once, at start
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await receiver.aclose()
    print(f"spans={len(receiver.spans)} exports={receiver.num_exports}", flush=True)


if __name__ == "__main__":
    import sys

    asyncio.run(_serve_forever(sys.argv[1]))
