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
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from admission.controller import Admission
from admission.idempotency import StoredResponse
from billing.records import idempotent_record_id
from billing.service import Billing
from core.errors import ClientDisconnectedError, TandemError
from core.messages import Endpoint
from core.request import Request, RequestPhase
from gateway.auth import Caller
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
from gateway.serving.gate import ClientGone, Gate, unless_client_leaves
from gateway.serving.idempotent import IdempotentKey, IdempotentRuns
from gateway.serving.output_filter import CONTENT_FILTER, OutputFilter
from gateway.serving.relay import Relay, log_request_end
from gateway.serving.routing import DecodeLeg, Router, answer_usage
from gateway.serving.sse import StreamSource
from gateway.serving.usage_records import UsageRecorder

log = logging.getLogger("tandem.requests")


@dataclass(frozen=True, slots=True)
class ServingServices:
    """What serving uses, built once by the app's assembly (``gateway/assembly/app.py``)."""

    router: Router
    gate: Gate
    content: ContentPolicy
    idempotency: IdempotentRuns
    metrics: GatewayMetrics
    deadlines: DeadlineConfig
    ping_interval_s: float
    billing: Billing | None = None
    """The usage ledger; None when billing is switched off."""


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

    def receive(
        self, endpoint: Endpoint, body: dict[str, Any], caller: Caller, deadline: float | None
    ) -> Request:
        """The request for a validated body (404 for a model this gateway does not serve)."""
        model = self._s.router.check_model(str(body["model"]))
        request = Request.receive(
            uuid.uuid4().hex, endpoint, model, body,
            tenant_id=caller.tenant.tenant_id,
            key_id=caller.key.key_id if caller.key is not None else None,
            deadline=deadline,
        )  # fmt: skip
        request.advance(RequestPhase.AUTHENTICATED)
        return request

    async def serve(
        self,
        request: Request,
        caller: Caller,
        idempotency_key: str | None,
        body_fingerprint: str,
        client_gone: ClientGone,
    ) -> Outcome:
        """Moderate the input, claim the idempotency key, and run the request."""
        s = self._s
        policy = s.content.policy_for(caller.tenant)
        await s.content.check_input(request, policy)
        request.advance(RequestPhase.MODERATED)
        claim: IdempotentKey | None = None
        if idempotency_key is not None:
            tenant_id = caller.tenant.tenant_id
            outcome = await self._claim(request, tenant_id, idempotency_key, body_fingerprint)
            if isinstance(outcome, StoredResponse):
                return Replayed(outcome)
            claim = outcome
            # Every run of this key is one ledger record: a re-run after a restart is not
            # billed twice.
            request.bill_as(
                idempotent_record_id(tenant_id, request.endpoint.value, idempotency_key)
            )
        try:
            s.router.check_decode_available()
        except TandemError:
            if claim is not None:
                await s.idempotency.release(claim)
            raise
        head = ResponseHead({"x-request-id": request.request_id})
        output_filter = s.content.output_filter(request, policy)
        if claim is not None:
            # An idempotent request runs to the end whatever its client does: its retry gets it.
            run = self.run(request, caller, head, output_filter, client_gone=None)
            if request.stream:
                return Streaming(s.idempotency.stream(claim, request, run, head))
            return Answered(await s.idempotency.complete(claim, request, run), head.headers)
        run = self.run(request, caller, head, output_filter, client_gone)
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
    ) -> Run:
        """Admit, route, run the legs and relay; end, settle and bill (module docstring).

        With ``client_gone``, a hang-up while queued leaves the queue, and one during a
        non-streaming answer aborts the engine call; ``None`` runs it to the end."""
        s = self._s
        admission: Admission | None = None
        recorder = UsageRecorder(s.billing, request) if s.billing is not None else None
        relay: Relay | None = None
        last: Item | None = None
        try:
            with head.on_errors():
                admission = await self._admit(caller, request, head, client_gone)
                leg = await self._legs(request, client_gone)
            if leg.answer is not None:
                last = await self._answer(request, leg.answer, admission, output_filter, recorder)
            else:
                relay = Relay(leg, request, output_filter, admission.charge_output)
                yield OPENED
                async with aclosing(relay.chunks()) as chunks:
                    async for chunk in chunks:
                        if recorder is not None:
                            recorder.on_chunk(chunk)
                        yield chunk
                request.finish(relay.finish_reason, relay.usage)
                last = StreamEnd()
        except (asyncio.CancelledError, GeneratorExit, ClientDisconnectedError):
            request.abort()
            log.info("request %s aborted: the client went away", request.request_id)
            raise
        except TandemError as exc:
            request.fail(exc.code)
            if relay is None:  # nothing sent yet: the error is the response's status
                if admission is not None:
                    log.warning("request %s failed: %s (%s)", request.request_id, exc.message,
                                exc.code)  # fmt: skip
                raise
            # Headers are gone: the error becomes one event and the stream ends (docs/WIRE.md §1).
            log.warning("request %s failed mid-stream: %s", request.request_id, exc.message)
            last = StreamEnd(exc)
        except Exception:
            # A bug: the client gets the catch-all 500 from gateway/errors.py; count it as failed.
            request.fail("internal_error")
            raise
        finally:
            if relay is not None:
                relay.close()  # dropping the connection aborts the engine's request
            if admission is not None:  # refusals at admission count as rejections instead
                log_request_end(request)
                s.metrics.observe_end(request, str(admission.tenant.plan.band))
                await s.gate.settle(admission, request)
                if recorder is not None:
                    recorder.record()
        assert last is not None  # set on every way out of the try that does not raise
        yield last

    async def _admit(
        self,
        caller: Caller,
        request: Request,
        head: ResponseHead,
        client_gone: ClientGone | None,
    ) -> Admission:
        """The quota reserved and a slot in the fair queue; the head learns both."""
        try:
            return await self._s.gate.admit(
                caller, request, client_gone, on_reserved=head.quota_reserved
            )
        finally:
            head.admission_ended(request.queue_wait_s)

    async def _legs(self, request: Request, client_gone: ClientGone | None) -> DecodeLeg:
        """Route, the prefill leg and the hand-off, the decode leg to its first byte (or its
        whole answer), within the request's deadline."""
        router = self._s.router
        what = "before the first token" if request.stream else "before the answer was complete"

        async def legs() -> DecodeLeg:
            async with within_deadline(request.deadline, what):
                route = router.route(request)
                handle = None
                if route.prefill is not None:
                    handle = await router.prefill(request, route.prefill)
                return await router.decode(request, route, handle)

        if request.stream or client_gone is None:
            return await legs()
        # Nobody reads the error if the client left; it is for logs and counters.
        return await unless_client_leaves(
            legs(), client_gone, "The client closed the connection before the answer."
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
