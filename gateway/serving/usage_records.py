"""One billed request's ``UsageRecord``, built from the gateway's ``Request`` when it ends.

Every admitted request is recorded exactly once (the flow calls ``record()`` after the
quota is settled): completed, failed and aborted alike, with the engine's usage or, for a
stream cut without it, what was streamed. For a tenant that keeps a request log, the prompt and
the output are captured too and scrubbed of PII before they leave the gateway.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from billing.records import RequestStatus, UsageRecord
from billing.service import Billing
from core.request import Request, RequestPhase
from gateway.serving.events import choice_text
from moderation.redact import scrub_pii

log = logging.getLogger("tandem.billing")

_STATUS = {
    RequestPhase.FINISHED: RequestStatus.COMPLETED,
    RequestPhase.FAILED: RequestStatus.FAILED,
    RequestPhase.ABORTED: RequestStatus.ABORTED,
}


class UsageRecorder:
    """Records one request with billing; created per request by the OpenAI routes."""

    def __init__(self, billing: Billing, request: Request) -> None:
        self._billing = billing
        self._request = request
        self._recorded = False
        keeps_log = request.tenant_id is not None and (
            billing.request_log_retention_s(request.tenant_id) is not None
        )
        self._output: list[str] | None = [] if keeps_log else None
        if keeps_log:
            request.keep_prompt()

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        """A chunk the client received (kept only for a tenant with a request log)."""
        self._keep(chunk, streamed=True)

    def on_result(self, result: dict[str, Any]) -> None:
        """A non-streaming answer the client received."""
        self._keep(result, streamed=False)

    def _keep(self, received: dict[str, Any], *, streamed: bool) -> None:
        if self._output is None:
            return
        for choice in received.get("choices") or ():
            text = choice_text(choice, self._request.endpoint, streamed=streamed)
            if text is not None:
                self._output.append(text)

    def record(self) -> None:
        """Hand the request's record to billing (once; later calls do nothing)."""
        if self._recorded:
            return
        self._recorded = True
        record = usage_record(self._request)
        prompt_output = None
        if self._output is not None:
            prompt_output = (
                scrub_pii(orjson.dumps(self._request.prompt.raw).decode()),
                scrub_pii("".join(self._output)),
            )
        try:
            self._billing.record(record, prompt_output)
        except Exception:
            # A billing bug must not turn a served answer into an error. The whole record is
            # in the log line, so it can be re-entered by hand.
            log.exception("request %s could not be billed: %r", record.request_id, record)


def usage_record(request: Request) -> UsageRecord:
    """The unpriced record of a request (billing prices it)."""
    model = request.model
    if request.tenant_id is None:
        raise ValueError(f"request {request.request_id} has no tenant: it cannot be billed")
    now_wall_us = time.time_ns() // 1000
    ended = request.finished_at if request.finished_at is not None else time.monotonic()
    finished_at_us = now_wall_us - round((time.monotonic() - ended) * 1e6)
    started_at_us = finished_at_us - round((ended - request.started_at) * 1e6)
    usage = request.usage
    prompt_tokens = usage.prompt_tokens if usage else 0
    completion_tokens = request.output_tokens
    cached_tokens = min(usage.cached_tokens, prompt_tokens) if usage else 0
    ttft_s = request.ttft_s
    status = _STATUS.get(request.phase, RequestStatus.FAILED)
    # An idempotent request's answer is stored and replayed: its completed run is billed once
    # whatever re-runs a restart causes. A run that failed or was cut short did work of its own
    # and frees the key, so its retry is a new request: those keep the request id.
    record_id = request.request_id
    if status is RequestStatus.COMPLETED and request.record_id is not None:
        record_id = request.record_id
    return UsageRecord(
        record_id=record_id,
        request_id=request.request_id,
        tenant_id=request.tenant_id,
        key_id=request.key_id,
        model=model.name,
        model_version=model.version or model.name,
        deployment=model.deployment,
        endpoint=request.endpoint.value,
        path=None if request.path is None else request.path.value,
        status=status,
        finish_reason=request.finish_reason,
        error_code=request.error_code
        if request.phase.is_terminal
        else request.error_code or "internal_error",
        moderation_action=request.moderation_action,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=cached_tokens,
        ttft_us=None if ttft_s is None else round(ttft_s * 1e6),
        e2e_us=finished_at_us - started_at_us,
        started_at_us=started_at_us,
        finished_at_us=finished_at_us,
        cost_micros=0,
        price_effective_from_us=None,
        currency="",
    )
