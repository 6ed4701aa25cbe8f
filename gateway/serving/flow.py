"""The one owner of a request's way through the gateway, from its route to its bill.

    serve():  moderate input -> idempotency claim (replay / run) -> run(), answered live or
              in the background (idempotent requests run to the end whatever the client does)
    run():    admit -> route -> prefill leg -> hand-off -> decode leg (to the first byte)
              -> relay with the output filter (or the whole answer, filtered)
              -> end the request -> settle the quota -> bill

``run`` is an async generator with one ``try / except / finally``: it decides how the request
ends (finished, failed, aborted), and its ``finally`` settles the quota and bills, exactly once,
however the client's side ends (the last event, a hang-up, a failure, a cancelled task). The
last event (``[DONE]`` or the error event) is yielded after that, so a client that sends its
next request on reading it finds this one's quota settled and its concurrency slot free. The
steps it calls (``Gate``, ``Router``, ``Relay``, ``UsageRecorder``) return values and record
on the ``Request``; none calls back into the flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from admission.controller import Admission
from admission.idempotency import StoredResponse
from billing.records import idempotent_record_id
from billing.service import Billing
from core.errors import ClientDisconnectedError, TandemError
from core.ids import random_hex
from core.messages import Endpoint
from core.request import Request, RequestPhase
from gateway.auth import Caller
from gateway.catalog import Catalog
from gateway.metrics import GatewayMetrics
from gateway.serving.content_policy import ContentPolicy
from gateway.serving.deadlines import DeadlineConfig, within_deadline
from gateway.serving.events import (
    OPENED,
    Item,
    LiveStream,
    ResponseHead,
    Run,
    StreamEnd,
    answer_of,
)
from gateway.serving.gate import Gate
from gateway.serving.hangup import ClientGone, unless_client_leaves
from gateway.serving.idempotent import IdempotentKey, IdempotentRuns
from gateway.serving.output_filter import CONTENT_FILTER, OutputFilter
from gateway.serving.relay import Relay, log_request_end
from gateway.serving.routing import DecodeLeg, Router, answer_usage
from gateway.serving.shadow import PrimaryOutcome, PrimaryOutput, ShadowRunner
from gateway.serving.sse import StreamSource
from gateway.serving.usage_records import UsageRecorder
from telemetry.request_trace import NO_TRACE, RequestTrace
from telemetry.tracing import Tracing
from traffic.backlog import Backlog
from traffic.resolver import Subject
from traffic.windows import RequestFigures, VersionWindows
from workers.deployments import Deployment

log = logging.getLogger("tandem.requests")
_NO_STEP = contextlib.nullcontext()

VERSION_HEADER = "x-tandem-model-version"
"""The version that serves the request (its body's ``model`` names it too)."""


@dataclass(frozen=True, slots=True)
class ServingServices:
    """What serving uses, built once by the app's assembly (``gateway/assembly/app.py``)."""

    catalog: Catalog
    """The deployed versions and the traffic policies choosing among them."""
    router: Router
    gate: Gate
    content: ContentPolicy
    idempotency: IdempotentRuns
    metrics: GatewayMetrics
    deadlines: DeadlineConfig
    ping_interval_s: float
    windows: VersionWindows
    """Per-version figures (latency, errors, tokens) over sliding windows: rollout gates."""
    shadows: ShadowRunner
    tracing: Tracing
    """Each request's trace (an inert one while tracing is off)."""
    billing: Billing | None = None
    """The usage ledger; None when billing is switched off."""
    backlog: Backlog = field(default_factory=Backlog)
    """Requests waiting for their first token, per version (the planner's prefill backlog)."""


@dataclass(frozen=True, slots=True)
class Replayed:
    """A stored answer to an idempotent retry."""

    stored: StoredResponse


@dataclass(frozen=True, slots=True)
class Streaming:
    source: StreamSource


@dataclass(frozen=True, slots=True)
class Answered:
    body: dict[str, Any]
    headers: dict[str, str]


Outcome = Replayed | Streaming | Answered


class RequestFlow:
    """Serves the OpenAI routes' requests over the gateway's services (stateless: a route
    makes one per request)."""

    def __init__(self, services: ServingServices) -> None:
        self._s = services
        self._shadow: Deployment | None = None
        self._shadow_max_in_flight = 0
        self._defaults_filled: tuple[str, ...] = ()

    def receive(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        caller: Caller,
        deadline: float | None,
        session: str | None = None,
    ) -> Request:
        """The request for a validated body, resolved to one version by the alias's traffic
        policy (404 for a model this gateway does not serve). The version's generation
        defaults fill what the body leaves unset, and its workers' name replaces ``model``."""
        tenant_id = caller.tenant.tenant_id
        key_id = caller.key.key_id if caller.key is not None else None
        user = body.get("user") or body.get("safety_identifier")
        resolved = self._s.catalog.resolve(
            str(body["model"]),
            Subject(tenant_id, key_id, user if isinstance(user, str) else None, session),
        )
        model = resolved.deployment.model
        self._defaults_filled = model.defaults.apply(body, chat=endpoint is Endpoint.CHAT)
        body["model"] = model.engine_name
        self._shadow = resolved.shadow
        self._shadow_max_in_flight = resolved.shadow_max_in_flight
        request = Request.receive(
            random_hex(), endpoint, model, body,
            tenant_id=tenant_id, key_id=key_id, deadline=deadline,
        )  # fmt: skip
        request.resolved_by = resolved.reason
        request.advance(RequestPhase.AUTHENTICATED)
        return request

    async def serve(
        self,
        request: Request,
        caller: Caller,
        idempotency_key: str | None,
        body_fingerprint: str,
        client_gone: ClientGone,
        trace: RequestTrace = NO_TRACE,
    ) -> Outcome:
        """Moderate the input, claim the idempotency key, and run the request."""
        s = self._s
        policy = s.content.policy_for(caller.tenant)
        with trace.span("tandem.moderation.input"):
            await s.content.check_input(request, policy)
        request.advance(RequestPhase.MODERATED)
        claim: IdempotentKey | None = None
        if idempotency_key is not None:
            tenant_id = caller.tenant.tenant_id
            with trace.span("tandem.idempotency") as span:
                outcome = await self._claim(request, tenant_id, idempotency_key, body_fingerprint)
                replayed = isinstance(outcome, StoredResponse)
                span.set_attribute("tandem.idempotency.outcome", "replayed" if replayed else "run")
            if isinstance(outcome, StoredResponse):
                return Replayed(outcome)
            claim = outcome
            # Every run of this key is one ledger record: a re-run after a restart is not
            # billed twice.
            request.bill_as(
                idempotent_record_id(tenant_id, request.endpoint.value, idempotency_key)
            )
        try:
            s.router.check_decode_available(request)
        except TandemError:
            if claim is not None:
                await s.idempotency.release(claim)
            raise
        head = ResponseHead(
            {"x-request-id": request.request_id, VERSION_HEADER: request.model.version_name}
        )
        output_filter = s.content.output_filter(request, policy)
        if claim is not None:
            # An idempotent request runs to the end whatever its client does: its retry gets it.
            run = self.run(request, caller, head, output_filter, None, trace)
            if request.stream:
                return Streaming(s.idempotency.stream(claim, request, run, head, client_gone))
            return Answered(await s.idempotency.complete(claim, request, run), head.headers)
        run = self.run(request, caller, head, output_filter, client_gone, trace)
        if request.stream:
            return Streaming(LiveStream(run, head))
        return Answered(await answer_of(run), head.headers)

    async def run(
        self,
        request: Request,
        caller: Caller,
        head: ResponseHead,
        output_filter: OutputFilter | None,
        client_gone: ClientGone | None,
        trace: RequestTrace = NO_TRACE,
    ) -> Run:
        """Admit, route, run the legs and relay; end, settle and bill (module docstring).

        With ``client_gone``, a hang-up while queued leaves the queue, and one before the
        first token (or a non-streaming answer) aborts the engine call; ``None`` runs it to
        the end. The request's trace ends here too, after its bill."""
        s = self._s
        admission: Admission | None = None
        recorder = UsageRecorder(s.billing, request) if s.billing is not None else None
        relay: Relay | None = None
        leg: DecodeLeg | None = None
        failure: BaseException | None = None
        last: Item | None = None
        shadowed: asyncio.Future[PrimaryOutcome] | None = None
        primary: PrimaryOutput | None = None
        try:
            with head.on_errors(), s.backlog.waiting(request):
                admission = await self._admit(caller, request, head, client_gone, trace)
                shadowed = self._start_shadow(request)
                primary = PrimaryOutput(request.endpoint) if shadowed is not None else None
                leg = await self._legs(request, client_gone, trace)
            if leg.answer is not None:
                with trace.span("tandem.moderation.output") if output_filter else _NO_STEP:
                    last = await self._answer(
                        request, leg.answer, admission, output_filter, recorder
                    )
                if primary is not None:
                    primary.on_answer(last)  # as the client gets it, as a stream's chunks
            else:
                relay = Relay(leg, request, output_filter, admission.charge_output)
                yield OPENED
                async with aclosing(relay.chunks()) as chunks:
                    async for chunk in chunks:
                        if recorder is not None:
                            recorder.on_chunk(chunk)
                        if primary is not None:
                            primary.on_chunk(chunk)
                        yield chunk
                request.finish(relay.finish_reason, relay.usage)
                last = StreamEnd()
        except (asyncio.CancelledError, GeneratorExit, ClientDisconnectedError):
            request.abort()
            log.info("request %s aborted: the client went away", request.request_id)
            raise
        except TandemError as exc:
            request.fail(exc.code)
            failure = exc
            if relay is None:  # nothing sent yet: the error is the response's status
                if admission is not None:
                    log.warning("request %s failed: %s (%s)", request.request_id, exc.message,
                                exc.code)  # fmt: skip
                raise
            # Headers are gone: the error becomes one event and the stream ends (docs/WIRE.md §1).
            log.warning("request %s failed mid-stream: %s", request.request_id, exc.message)
            last = StreamEnd(exc)
        except Exception as exc:
            # A bug: the client gets the catch-all 500 from gateway/errors.py; count it as failed.
            request.fail("internal_error")
            failure = exc
            raise
        finally:
            if relay is not None:
                relay.close()  # dropping the connection aborts the engine's request
            if leg is not None:  # a stream's leg ends with it (an answer's already ended)
                leg.span.end(
                    error=failure, attributes={"tandem.stream.chunks": request.num_streamed_tokens}
                )
            if shadowed is not None and not shadowed.done():
                # done: its copy was cancelled (the gateway is stopping); settle and bill anyway.
                shadowed.set_result(_primary_outcome(request, primary))
            if admission is not None:  # refusals at admission count as rejections instead
                log_request_end(request, trace.trace_id)
                band = str(admission.tenant.plan.band)
                s.metrics.observe_end(request, band, trace_id=trace.trace_id)
                _observe_version(s.windows, request)
                with trace.span("tandem.billing"):
                    await s.gate.settle(admission, request)
                    if recorder is not None:
                        recorder.record()
            trace.end(request, failure)
        assert last is not None  # set on every way out of the try that does not raise
        yield last

    def _start_shadow(self, request: Request) -> asyncio.Future[PrimaryOutcome] | None:
        """The shadow copy of an admitted request, if its policy drew one (not billed, not
        charged, capped: gateway/serving/shadow.py)."""
        if self._shadow is None:
            return None
        return self._s.shadows.start(
            request, self._defaults_filled, self._shadow, self._shadow_max_in_flight
        )

    async def _admit(
        self,
        caller: Caller,
        request: Request,
        head: ResponseHead,
        client_gone: ClientGone | None,
        trace: RequestTrace,
    ) -> Admission:
        """The quota reserved and a slot in the fair queue; the head learns both."""
        with trace.span("tandem.admission.queue") as span:
            try:
                admission = await self._s.gate.admit(
                    caller, request, client_gone, on_reserved=head.quota_reserved
                )
            finally:
                head.admission_ended(request.queue_wait_s)
            span.set_attributes(
                {
                    "tandem.queue.band": str(admission.tenant.plan.band),
                    "tandem.queue.wait_s": request.queue_wait_s or 0.0,
                }
            )
        trace.set("tandem.queue.band", str(admission.tenant.plan.band))
        return admission

    async def _legs(
        self, request: Request, client_gone: ClientGone | None, trace: RequestTrace
    ) -> DecodeLeg:
        """Route, the prefill leg and the hand-off, the decode leg to its first byte (or its
        whole answer), within the request's deadline."""
        router = self._s.router
        what = "before the first token" if request.stream else "before the answer was complete"

        async def legs() -> DecodeLeg:
            async with within_deadline(request.deadline, what):
                route = router.route(request)
                handle = None
                if route.prefill is not None:
                    handle = await router.prefill(request, route.prefill, trace)
                return await router.decode(request, route, handle, trace)

        if client_gone is None:
            return await legs()
        # A stream hears its client leave before the first token from here, as its response
        # opens it (gateway/serving/sse.py). Nobody reads the error; it is for the logs.
        return await unless_client_leaves(
            legs(), client_gone, f"The client closed the connection {what}."
        )

    async def _answer(
        self,
        request: Request,
        answer: dict[str, Any],
        admission: Admission,
        output_filter: OutputFilter | None,
        recorder: UsageRecorder | None,
    ) -> dict[str, Any]:
        """A non-streaming answer, through the output filter; the request ends with it. Its
        output is charged to the fair queue at once (a stream's is charged as it flows)."""
        choices = answer.get("choices") or [{}]
        finish_reason = choices[0].get("finish_reason")
        request.mark_first_token()
        if output_filter is not None:
            await output_filter.filter_response(answer)
            if output_filter.blocked:
                finish_reason = CONTENT_FILTER
        if recorder is not None:
            recorder.on_result(answer)
        usage = answer_usage(answer)
        if usage is not None:
            admission.charge_output(usage.completion_tokens)
        request.finish(finish_reason, usage)
        return answer

    async def _claim(
        self, request: Request, tenant_id: str, key: str, body_fingerprint: str
    ) -> IdempotentKey | StoredResponse:
        s = self._s
        try:
            claim = await s.idempotency.claim(
                tenant_id, request.endpoint, key, body_fingerprint, request
            )
        except TandemError as exc:
            s.metrics.observe_idempotency(exc.code or "error")
            raise
        s.metrics.observe_idempotency("run" if isinstance(claim, IdempotentKey) else "replayed")
        return claim


def _primary_outcome(request: Request, output: PrimaryOutput | None) -> PrimaryOutcome:
    completed = request.phase is RequestPhase.FINISHED and output is not None
    usage = request.usage
    return PrimaryOutcome(
        text=output.text if completed and output is not None else None,
        tokens=usage.completion_tokens if usage is not None else None,
        finish_reason=request.finish_reason,
    )


def _observe_version(windows: VersionWindows, request: Request) -> None:
    """An admitted request's figures in its version's window; a client's hang-up says nothing
    about the version, so aborted requests are left out."""
    if request.phase is RequestPhase.ABORTED or request.e2e_s is None:
        return
    windows.observe(
        request.model.version_name,
        RequestFigures(
            ttft_s=request.ttft_s,
            itl_s=request.itl_s,
            e2e_s=request.e2e_s,
            # A client error from the engine has no code; it is still a failure of the version.
            error=(request.error_code or "invalid_request_error")
            if request.phase is RequestPhase.FAILED
            else None,
            output_tokens=request.output_tokens,
            input_tokens=request.input_tokens,
            finish_reason=request.finish_reason,
            moderation=request.moderation_action,
        ),
    )
