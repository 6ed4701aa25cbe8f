"""One request's span tree: a root for the request, a child per step, the legs' spans the
parents of the workers' own.

    chat <model>                      SERVER; GenAI attributes, tandem.* ones, the outcome
      tandem.authenticate
      tandem.moderation.input
      tandem.idempotency              only with an Idempotency-Key
      tandem.admission.queue          tandem.queue.wait_s, tandem.queue.band
      tandem.prefill                  CLIENT; vLLM's llm_request span is its child
      tandem.kv_transfer              decode leg sent -> first token (disaggregated only)
      tandem.decode                   CLIENT; first_token event, tandem.stream.chunks;
                                      vLLM's span is its child. A failed leg ends with error
                                      status and tandem.fallback.reason; its re-run is another
                                      tandem.decode with tandem.retry.reason
      tandem.moderation.output        when the tenant's policy moderates output
      tandem.billing                  the quota settled and the ledger record written

The sampler decides once per request, under the client's ``traceparent``. Every span is a
``Step`` record (a name, an id, two timestamps, attributes), turned into the SDK's
``ReadableSpan`` and handed to the batching processor when the request ends: the spans an
exporter sees, without the SDK tracer's per-span machinery (sampling, context, locks,
attribute checks), which cost about 60 µs a span here. Steps that run while the
gateway waits are timed live; the KV hand-off and a stream's output moderation, interleaved
with other work, are written from the ``Request``'s timestamps. Prompt and output text are
never recorded, nor the API key: only its tenant's id. An inert ``NO_TRACE`` stands in when
tracing is off.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import Sampler
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import (
    INVALID_SPAN_CONTEXT,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from core.errors import TandemError
from core.messages import Endpoint, ServingPath
from core.moderation import Stage
from core.request import Request, RequestPhase

Attributes = dict[str, str | int | float | bool]
_PROPAGATOR = TraceContextTextMapPropagator()
_UNSET = Status(StatusCode.UNSET)


@dataclass(frozen=True, slots=True)
class TraceSink:
    """What a request's spans need: the sampler that decides on its root, span ids, and the
    processor, resource and scope its spans are handed to."""

    sampler: Sampler
    processor: SpanProcessor
    resource: Resource
    scope: InstrumentationScope
    ids: IdGenerator


def _ns(monotonic_s: float, anchor: tuple[float, int]) -> int:
    """A ``time.monotonic()`` reading as epoch nanoseconds (spans need wall-clock times)."""
    mono, epoch_ns = anchor
    return epoch_ns + int((monotonic_s - mono) * 1e9)


def _error_fields(exc: BaseException) -> tuple[str, Status | None]:
    """``error.type``, and the error status for the server's failures (a 4xx is the
    client's, as on HTTP server spans)."""
    if isinstance(exc, TandemError):
        status = Status(StatusCode.ERROR, exc.message) if exc.status_code >= 500 else None
        return exc.code or type(exc).__name__, status
    return type(exc).__name__, Status(StatusCode.ERROR, str(exc) or type(exc).__name__)


class Step:
    """One span of a request (its root or a child), recorded cheaply, exported when the
    request ends."""

    __slots__ = (
        "attributes",
        "end_ns",
        "events",
        "finish_reasons",
        "kind",
        "name",
        "span_id",
        "start_ns",
        "status",
    )  # fmt: skip

    def __init__(
        self, name: str, span_id: int, kind: SpanKind, start_ns: int, attributes: Attributes
    ) -> None:
        self.name = name
        self.span_id = span_id
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns: int | None = None
        self.attributes = attributes
        self.events: list[Event] = []
        self.status = _UNSET
        self.finish_reasons: tuple[str, ...] | None = None
        """``gen_ai.response.finish_reasons`` (a sequence: not a plain attribute value)."""

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, str | int | float | bool]) -> None:
        self.attributes.update(attributes)

    def fail(self, exc: BaseException) -> None:
        error_type, status = _error_fields(exc)
        self.attributes["error.type"] = error_type
        if status is not None:
            self.status = status

    def finish(self, end_ns: int | None = None) -> None:
        """End it, at ``end_ns`` or now (once: later calls do nothing)."""
        if self.end_ns is None:
            self.end_ns = end_ns or time.time_ns()


class _NoStep:
    """What ``span()`` yields while nothing is recorded."""

    __slots__ = ()

    def set_attribute(self, key: str, value: str | int | float | bool) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, str | int | float | bool]) -> None:
        pass


StepLike = Step | _NoStep
_NO_STEP: AbstractContextManager[StepLike] = nullcontext(_NoStep())


class LegSpan:
    """A call to a worker: its span, and the headers that put the worker's span under it."""

    __slots__ = ("_step", "headers")

    def __init__(self, step: Step | None, headers: dict[str, str]) -> None:
        self._step = step
        self.headers = headers

    def first_token(self) -> None:
        if self._step is not None and self._step.end_ns is None:
            self._step.events.append(Event("first_token", timestamp=time.time_ns()))

    def end(
        self, *, error: BaseException | None = None, attributes: Attributes | None = None
    ) -> None:
        """End the leg (once; later calls do nothing), failed when ``error`` is given: with
        error status whatever the error, since a failed leg is the server's."""
        step = self._step
        if step is None or step.end_ns is not None:
            return
        if error is not None:
            step.fail(error)
            step.status = Status(StatusCode.ERROR, getattr(error, "message", None) or str(error))
        if attributes:
            step.attributes.update(attributes)
        step.finish()


NO_LEG = LegSpan(None, {})


class RequestTrace:
    """The spans of one request (module docstring); ``trace_id`` is set when it is sampled."""

    __slots__ = ("_anchor", "_context", "_ended", "_parent", "_root", "_sink", "_steps",
                 "trace_id")  # fmt: skip

    def __init__(
        self,
        sink: TraceSink | None,
        context: SpanContext,
        parent: SpanContext | None = None,
        root: Step | None = None,
    ) -> None:
        """``context``: the root's, sampled or not; ``root``: its record, when sampled."""
        self._sink = sink
        self._context = context
        self._parent = parent
        self._root = root
        self._anchor = (time.monotonic(), time.time_ns())
        self._ended = False
        self._steps: list[Step] = []
        self.trace_id: str | None = None if root is None else otel.format_trace_id(context.trace_id)

    @classmethod
    def start(cls, sink: TraceSink, headers: Mapping[str, str], operation: str) -> RequestTrace:
        """The root, a child of the client's ``traceparent`` when it sent one; the sampler
        decides whether it is recorded."""
        client = otel.get_current_span(_PROPAGATOR.extract(headers)).get_span_context()
        parent = client if client.is_valid else None
        trace_id = sink.ids.generate_trace_id() if parent is None else parent.trace_id
        attributes: Attributes = {"gen_ai.operation.name": operation}
        decision = sink.sampler.should_sample(
            None if parent is None else otel.set_span_in_context(NonRecordingSpan(parent)),
            trace_id,
            operation,
            SpanKind.SERVER,
            attributes,
        )
        sampled = decision.decision.is_sampled()  # type: ignore[no-untyped-call]  # the SDK's
        context = SpanContext(
            trace_id,
            sink.ids.generate_span_id(),
            False,
            TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT),
            decision.trace_state,
        )
        if not sampled:
            return cls(sink, context, parent)
        root = Step(operation, context.span_id, SpanKind.SERVER, time.time_ns(), attributes)
        return cls(sink, context, parent, root)

    @property
    def recording(self) -> bool:
        return self._root is not None and not self._ended

    def _step(
        self, name: str, kind: SpanKind, attributes: Attributes, start_ns: int | None = None
    ) -> Step:
        assert self._sink is not None
        step = Step(
            name, self._sink.ids.generate_span_id(), kind, start_ns or time.time_ns(), attributes
        )
        self._steps.append(step)
        return step

    def span(self, name: str, **attributes: Any) -> AbstractContextManager[StepLike]:
        """A live child span around a step; an exception out of it marks it failed."""
        if not self.recording:
            return _NO_STEP
        return self._live(name, attributes)

    @contextmanager
    def _live(self, name: str, attributes: Attributes) -> Iterator[StepLike]:
        step = self._step(name, SpanKind.INTERNAL, attributes)
        try:
            yield step
        except BaseException as exc:
            step.fail(exc)
            raise
        finally:
            step.finish()

    def leg(self, name: str, worker: str, attributes: Attributes | None = None) -> LegSpan:
        """The span of a call to ``worker``, started now, with the ``traceparent`` to send.
        A request sampled out still sends its context: the worker follows the decision
        rather than starting a trace of its own."""
        if self._sink is None:
            return NO_LEG
        context = self._context
        if not self.recording:
            return LegSpan(None, _trace_headers(context, context.span_id))
        step = self._step(name, SpanKind.CLIENT, {"tandem.worker": worker, **(attributes or {})})
        return LegSpan(step, _trace_headers(context, step.span_id))

    def received(self, request: Request) -> None:
        """What the request asked for, once its body is read and its version resolved."""
        root = self._root
        if root is None or self._ended:
            return
        operation = operation_name(request.endpoint)
        root.name = f"{operation} {request.model.name}"
        root.set_attributes(
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": request.model.name,
                "tandem.request.id": request.request_id,
                "tandem.model.version": request.model.version_name,
                "tandem.model.resolved_by": request.resolved_by or "",
                "tandem.stream": request.stream,
            }
        )
        if request.tenant_id is not None:
            root.set_attribute("tandem.tenant.id", request.tenant_id)
        max_tokens = request.body.get("max_tokens") or request.body.get("max_completion_tokens")
        if isinstance(max_tokens, int):
            root.set_attribute("gen_ai.request.max_tokens", max_tokens)

    def set(self, key: str, value: str | int | float | bool) -> None:
        if self._root is not None and not self._ended:
            self._root.set_attribute(key, value)

    def end(self, request: Request | None = None, error: BaseException | None = None) -> None:
        """End the root and hand every span over (once; later calls do nothing): how
        ``request`` went, or the ``error`` that ended it before it ran."""
        root = self._root
        if self._ended or root is None:
            self._ended = True
            return
        if request is not None:
            self._record_request(root, request, error is None)
        if error is not None:
            root.fail(error)
        self._ended = True
        root.finish()
        self._export(root, self._parent)
        for step in self._steps:
            step.finish()  # one still open (a leg of a request a bug ended) ends now
            self._export(step, self._context)
        self._steps = []

    def _record_request(self, root: Step, request: Request, no_exception: bool) -> None:
        attributes: Attributes = {
            "gen_ai.response.model": request.model.version_name,
            "tandem.outcome": request.phase.name.lower(),
        }
        if request.path is not None:
            attributes["tandem.path"] = str(request.path)
            attributes["tandem.path.reason"] = request.path_reason or ""
        if request.engine_ran:
            attributes["gen_ai.response.id"] = request.response_id
        if request.usage is not None:
            attributes["gen_ai.usage.input_tokens"] = request.usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = request.usage.completion_tokens
        if request.kv_blocks is not None:
            attributes["tandem.kv.blocks"] = request.kv_blocks
        if request.kv_bytes is not None:
            attributes["tandem.kv.bytes"] = request.kv_bytes
        root.set_attributes(attributes)
        if request.finish_reason is not None:
            root.finish_reasons = (request.finish_reason,)
        if request.phase is RequestPhase.FAILED and no_exception:
            root.set_attribute("error.type", request.error_code or "error")
            root.status = Status(StatusCode.ERROR, request.error_code or "failed")
        self._record_interleaved(request)

    def _record_interleaved(self, request: Request) -> None:
        """The steps that overlapped others, from the request's own timestamps."""
        first, sent = request.first_token_at, request.decode_sent_at
        if request.path is ServingPath.DISAGGREGATED and first is not None and sent is not None:
            step = self._step(
                "tandem.kv_transfer",
                SpanKind.INTERNAL,
                {
                    "tandem.kv.blocks": request.kv_blocks or 0,
                    "tandem.kv.bytes": request.kv_bytes or 0,
                    "tandem.prefill.worker": request.prefill_worker or "",
                    "tandem.decode.worker": request.decode_worker or "",
                },
                _ns(sent, self._anchor),
            )
            step.finish(_ns(first, self._anchor))
        output = [d for d in request.moderation if d.stage is Stage.OUTPUT]
        if request.stream and first is not None and output:
            step = self._step(
                "tandem.moderation.output",
                SpanKind.INTERNAL,
                {
                    "tandem.moderation.decisions": len(output),
                    "tandem.moderation.action": request.moderation_action or "allow",
                },
                _ns(first, self._anchor),
            )
            step.finish(_ns(request.finished_at or time.monotonic(), self._anchor))

    def _export(self, step: Step, parent: SpanContext | None) -> None:
        """``step`` as the SDK's finished span, to the batching processor."""
        sink = self._sink
        assert sink is not None
        trace = self._context
        attributes: dict[str, Any] = step.attributes
        if step.finish_reasons is not None:
            attributes = {**attributes, "gen_ai.response.finish_reasons": step.finish_reasons}
        sink.processor.on_end(
            ReadableSpan(
                step.name,
                context=SpanContext(
                    trace.trace_id, step.span_id, False, trace.trace_flags, trace.trace_state
                ),
                parent=parent,
                resource=sink.resource,
                attributes=attributes,
                events=step.events,
                kind=step.kind,
                status=step.status,
                start_time=step.start_ns,
                end_time=step.end_ns,
                instrumentation_scope=sink.scope,
            )
        )


def _trace_headers(parent: SpanContext, span_id: int) -> dict[str, str]:
    """W3C trace context naming ``span_id`` (in ``parent``'s trace) as the caller."""
    headers = {
        "traceparent": f"00-{parent.trace_id:032x}-{span_id:016x}-{int(parent.trace_flags):02x}"
    }
    if parent.trace_state:
        headers["tracestate"] = parent.trace_state.to_header()
    return headers


NO_TRACE = RequestTrace(None, INVALID_SPAN_CONTEXT)
"""Every request's trace while tracing is off."""


def operation_name(endpoint: Endpoint) -> str:
    """``gen_ai.operation.name`` of a route."""
    return "chat" if endpoint is Endpoint.CHAT else "text_completion"
