"""The admission gate the flow passes through: authenticate, estimate, admit; and settle.

Authorization -> Caller (401) -> output cap and token estimate (on the Request) ->
AdmissionController.admit (400/429/503) -> engine priority (band + fair position) -> the legs
... -> settle(used tokens): reconcile the quota, free the queue slot

A client that hangs up while its request waits for admission leaves the queue at once: the
server does not cancel a handler whose client left, so admission races the client's disconnect.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from admission.controller import (
    Admission,
    AdmissionController,
    check_context_window,
    used_tokens,
)
from admission.tokens import COMPLETIONS_DEFAULT_MAX_TOKENS, TokenCounters, estimate_tokens
from core.errors import (
    OverloadedError,
    TandemError,
)
from core.messages import Endpoint
from core.prompt import TokenEstimate
from core.request import Request
from gateway.auth import Authenticator, Caller
from gateway.metrics import GatewayMetrics
from gateway.serving.deadlines import deadline_error
from gateway.serving.hangup import ClientGone, unless_client_leaves

log = logging.getLogger("tandem.admission")


@dataclass(frozen=True, slots=True)
class GateConfig:
    """Admission timing the gate applies to every request."""

    queue_timeout_s: float = 60.0
    """Longest wait in the fair queue."""
    engine_priority: bool = False
    """Send each request's band and fair position to the engine as vLLM's ``priority``
    (``PriorityBand.engine_priority``; its workers must run ``--scheduling-policy priority``,
    which ``tandem up`` gives its own workers); False sends none and drops a client's."""


class Gate:
    """Admission for the OpenAI routes."""

    def __init__(
        self,
        config: GateConfig,
        authenticator: Authenticator,
        controller: AdmissionController,
        counters: TokenCounters,
        metrics: GatewayMetrics,
        check_budget: Callable[[str], None] | None = None,
    ) -> None:
        """``check_budget`` raises for a tenant whose monthly budget is spent."""
        self._config = config
        self._check_budget = check_budget
        self.authenticator = authenticator
        self._controller = controller
        self._counters = counters
        self._metrics = metrics

    async def authenticate(self, authorization: str | None) -> Caller:
        """The caller, or 401 (counted as a rejection)."""
        try:
            return await self.authenticator.authenticate(authorization)
        except TandemError as exc:
            self._metrics.observe_rejection(exc.code)
            raise

    async def admit(
        self,
        caller: Caller,
        request: Request,
        client_gone: ClientGone | None = None,
        on_reserved: Callable[[dict[str, str]], None] | None = None,
    ) -> Admission:
        """Reserve quota and wait for a slot; the caller must ``settle`` what this returns.

        The queue wait ends at the queue timeout or the request's own deadline, whichever
        comes first (504 ``deadline_exceeded`` for the latter). With ``client_gone``, a hang-up
        before admission gives everything back and raises ``ClientDisconnectedError``.
        ``on_reserved`` gets the rate-limit headers as soon as the quota is reserved (a stream
        that starts while still queued sends them)."""
        if self._check_budget is not None:
            try:
                self._check_budget(caller.tenant.tenant_id)
            except TandemError as exc:
                self._metrics.observe_rejection(exc.code)
                raise
        cap_output_tokens(request, caller.tenant.plan.max_output_tokens)
        model = request.model
        counter = await self._counters.for_dir(model.tokenizer_dir)
        estimate = await estimate_tokens(
            request.endpoint, request.body, request.prompt, counter, model.max_model_len
        )
        request.record_estimate(estimate)
        try:
            check_context_window(estimate, model.max_model_len)
        except TandemError as exc:
            self._metrics.observe_rejection(exc.code)
            raise
        deadline = time.monotonic() + self._config.queue_timeout_s
        if request.deadline is not None:
            deadline = min(deadline, request.deadline)
        admitting = self._admit_before_deadline(caller, estimate, deadline, request, on_reserved)
        try:
            if client_gone is None:
                admission = await admitting
            else:
                admission = await unless_client_leaves(
                    admitting,
                    client_gone,
                    "The client closed the connection while queued.",
                    discard=_settle_unused,
                )
        except TandemError as exc:
            self._metrics.observe_rejection(exc.code)
            log.info(
                "request %s of tenant %s refused at admission: %s (%s)",
                request.request_id, caller.tenant.name, exc.message, exc.code,
            )  # fmt: skip
            raise
        # Decided here, after the grant (the band and the tenant's fair position in it), and
        # always set: a client's own ``priority`` is replaced or dropped, never sent.
        priority = caller.tenant.plan.band.engine_priority(admission.fair_position)
        request.set_engine_priority(priority if self._config.engine_priority else None)
        request.admit(admission.queue_wait_s)
        self._metrics.observe_admitted(str(caller.tenant.plan.band), admission.queue_wait_s)
        return admission

    async def _admit_before_deadline(
        self,
        caller: Caller,
        estimate: TokenEstimate,
        deadline: float,
        request: Request,
        on_reserved: Callable[[dict[str, str]], None] | None,
    ) -> Admission:
        try:
            return await self._controller.admit(caller.tenant, estimate, deadline, on_reserved)
        except OverloadedError as exc:
            remaining = request.remaining_s()
            if remaining is not None and remaining <= 0:
                raise deadline_error("while it waited for admission") from exc
            raise

    async def settle(self, admission: Admission, request: Request) -> None:
        """Charge what the request really used and give the rest back (exactly once: later
        calls do nothing)."""
        if admission.settled:
            return
        spent = used_tokens(
            admission.estimate,
            request.usage,
            engine_ran=request.engine_ran,
            num_streamed=request.num_streamed_tokens,
        )
        await admission.settle(spent, ran=request.engine_ran)
        self._metrics.observe_charged(admission.tenant.name, spent)


def cap_output_tokens(request: Request, plan_max: int | None) -> None:
    """Give a request without ``max_tokens`` its cap: the plan's ``max_output_tokens``, else
    (chat) the served model's default, neither past the context window. Unset would mean "up
    to the context window": thousands of tokens streamed to a client that asked one question,
    and a reservation of the whole window against the tenant's TPM. Most clients never set it.
    (Completions default to 16 tokens, OpenAI's default: only a smaller plan cap changes them.)"""
    body, model, chat = request.body, request.model, request.endpoint is Endpoint.CHAT
    if any(body.get(field) is not None for field in ("max_tokens", "max_completion_tokens")):
        return
    if plan_max is not None:
        if chat or plan_max < COMPLETIONS_DEFAULT_MAX_TOKENS:
            request.cap_output(model.within_window(plan_max))
    elif chat and model.output_cap is not None:
        request.cap_output(model.output_cap)


async def _settle_unused(admission: Admission) -> None:
    """An admission granted as its client left: nothing will run it."""
    await admission.settle(0)
