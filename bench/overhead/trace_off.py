"""What tracing costs a request while it is off: the gateway's calls into ``tracing``.

With no OTLP endpoint configured, every request shares the inert ``NO_TRACE`` and each call
returns at once; the calls themselves remain. A build without them does not exist to compare
against, so ``one_request`` makes them, in the order and with the arguments one streamed,
disaggregated request makes them (gateway/serving/routes.py ``_serve``, flow.py
``RequestFlow.serve``/``run``/``_admit``, routing.py ``Router.prefill``/``decode``/
``_open_stream``), on real objects, and ``cpu_us_per_request`` times it with
``time.process_time_ns`` over many calls. The loop's own cost and the copies of the legs'
(empty) header dicts are counted in: the figure is an upper bound.
"""

from __future__ import annotations

import time

from starlette.datastructures import Headers

from admission.plans import PriorityBand
from core.messages import Endpoint
from core.models import ServedModel
from core.request import Request
from telemetry.request_trace import operation_name
from telemetry.tracing import Tracing, TracingConfig

MODEL = ServedModel("fake-model", 2048, 0)
_HEADERS = Headers(
    {
        "host": "127.0.0.1:8000",
        "authorization": "Bearer tdm-bench",
        "content-type": "application/json",
        "accept": "text/event-stream",
        "user-agent": "bench.overhead",
    }
)


def a_request() -> Request:
    """A request as the gateway holds it when tracing is first told about it."""
    body = {
        "model": MODEL.name,
        "stream": True,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": "the quick brown fox " * 25}],
    }
    return Request.receive("bench-1", Endpoint.CHAT, MODEL, body, tenant_id="ten_bench")


def one_request(
    tracing: Tracing, headers: Headers, request: Request, band: PriorityBand
) -> tuple[int, str | None]:
    """Every tracing call of one streamed, disaggregated request, in the gateway's order; what
    the gateway passes on from them (the legs' header count, the trace id for the log)."""
    # routes.py _serve: the trace starts under the client's headers.
    trace = tracing.start(headers, operation_name(request.endpoint))
    with trace.span("tandem.authenticate"):
        pass
    trace.received(request)
    # flow.py RequestFlow.serve, then _admit.
    with trace.span("tandem.moderation.input"):
        pass
    with trace.span("tandem.admission.queue") as span:
        span.set_attributes(
            {"tandem.queue.band": str(band), "tandem.queue.wait_s": request.queue_wait_s or 0.0}
        )
    trace.set("tandem.queue.band", str(band))
    # routing.py Router.prefill: the leg's span; its headers go with the leg's HTTP call.
    prefill = trace.leg("tandem.prefill", "fake-prefill")
    sent = len({**prefill.headers})
    prefill.end(attributes={"tandem.kv.blocks": 1})
    # Router.decode and _open_stream.
    decode = trace.leg("tandem.decode", "fake-decode")
    sent += len({**decode.headers})
    decode.first_token()
    # flow.py RequestFlow.run's finally: the leg ends with the stream, then the bill.
    decode.end(error=None, attributes={"tandem.stream.chunks": request.num_streamed_tokens})
    trace_id = trace.trace_id  # log_request_end's
    with trace.span("tandem.billing"):
        pass
    trace.end(request, None)
    return sent, trace_id


def cpu_us_per_request(num_requests: int = 200_000, repeats: int = 3) -> float:
    """CPU µs of ``one_request`` with tracing off, best of ``repeats`` rounds."""
    tracing = Tracing(TracingConfig())  # what the gateway builds with no OTEL_* endpoint
    if tracing.enabled:
        raise RuntimeError("TracingConfig() is expected to leave tracing off")
    request, band = a_request(), PriorityBand.STANDARD
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time_ns()
        for _ in range(num_requests):
            one_request(tracing, _HEADERS, request, band)
        best = min(best, time.process_time_ns() - started)
    return best / num_requests / 1000
