"""The gate in front of the pipeline: authenticate, estimate, admit; and settle at the end.

Authorization -> Caller (401) -> token estimate -> AdmissionController.admit (400/429/503)
-> pipeline ... -> settle(used tokens): reconcile the quota, free the queue slot
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from admission.controller import Admission, AdmissionController, used_tokens
from admission.tokens import TokenCounter, estimate_tokens
from core.errors import TandemError
from core.messages import Endpoint
from core.request import Request, RequestPhase
from gateway.auth import Authenticator, Caller
from gateway.metrics import GatewayMetrics

log = logging.getLogger("tandem.admission")


@dataclass(frozen=True, slots=True)
class GateConfig:
    """Admission timing the gate applies to every request."""

    queue_timeout_s: float = 60.0
    """Longest wait in the fair queue."""


class Gate:
    """Admission for the OpenAI routes."""

    def __init__(
        self,
        config: GateConfig,
        authenticator: Authenticator,
        controller: AdmissionController,
        counter: TokenCounter,
        metrics: GatewayMetrics,
    ) -> None:
        self._config = config
        self.authenticator = authenticator
        self._controller = controller
        self._counter = counter
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
        endpoint: Endpoint,
        body: dict[str, Any],
        request: Request,
        max_model_len: int | None,
    ) -> Admission:
        """Reserve quota and wait for a slot; the caller must ``settle`` what this returns."""
        estimate = await estimate_tokens(endpoint, body, self._counter, max_model_len)
        deadline = time.monotonic() + self._config.queue_timeout_s
        try:
            admission = await self._controller.admit(caller.tenant, estimate, deadline)
        except TandemError as exc:
            self._metrics.observe_rejection(exc.code)
            log.info(
                "request %s of tenant %s refused at admission: %s (%s)",
                request.request_id, caller.tenant.name, exc.message, exc.code,
            )  # fmt: skip
            raise
        request.queue_wait_s = admission.queue_wait_s
        request.advance(RequestPhase.ADMITTED)
        self._metrics.observe_admitted(str(caller.tenant.plan.band), admission.queue_wait_s)
        return admission

    async def settle(self, admission: Admission, request: Request) -> None:
        """Charge what the request really used and give the rest back (exactly once)."""
        spent = used_tokens(
            admission.estimate,
            request.usage,
            engine_ran=request.path is not None,  # a path is chosen just before the first leg
            num_streamed=request.num_streamed_tokens,
        )
        await admission.settle(spent)
        self._metrics.observe_charged(admission.tenant.name, spent)
