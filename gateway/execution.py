"""One accepted request from admission to its last byte: what it holds and how it lets go.

    Execution.open_stream() -> admit (quota, fair queue) -> pipeline.stream (legs, first token)
    Execution.events()      -> the relayed chunks, then [DONE] or one error event
    Execution.aclose()      -> close the relay (aborts the engine request), settle the quota

    Execution.complete()    -> the same for a non-streaming request, settled before it returns

Quota is settled exactly once, before the stream's last event when it ends normally, in
``aclose()`` otherwise (client gone, failure, never started). Headers grow as the request
advances: the request id at once, ``x-ratelimit-*`` when the quota is reserved,
``x-tandem-queue-ms`` when admitted. A stream that must start early (still queued or prefilling
after a heartbeat interval) starts once ``quota_answered()`` returns, so it always carries the
rate-limit headers and a quota refusal is always an HTTP 429.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from admission.controller import Admission
from core.errors import TandemError
from core.messages import Endpoint
from core.request import Request
from gateway.auth import Caller
from gateway.gate import ClientGone, Gate, unless_client_leaves
from gateway.output_filter import CONTENT_FILTER, OutputFilter
from gateway.pipeline import ServedModel, ServingPipeline
from gateway.relay import RelayHooks, RelayStream
from gateway.usage_records import UsageRecorder


class Execution:
    """Runs one request the gateway accepted; owns its admission and its relay."""

    def __init__(
        self,
        gate: Gate,
        pipeline: ServingPipeline,
        caller: Caller,
        endpoint: Endpoint,
        body: dict[str, Any],
        request: Request,
        model: ServedModel,
        client_gone: ClientGone | None,
        output_filter: OutputFilter | None = None,
        on_chunk: Callable[[dict[str, Any]], None] | None = None,
        recorder: UsageRecorder | None = None,
    ) -> None:
        """``client_gone`` lets a hang-up stop the request (leave the queue, cancel a
        non-streaming engine call); ``None`` runs it to the end whatever the client does.
        ``recorder`` bills the request once its quota is settled."""
        self.request = request
        self.headers: dict[str, str] = {"x-request-id": request.request_id}
        self._gate = gate
        self._pipeline = pipeline
        self._caller = caller
        self._endpoint = endpoint
        self._body = body
        self._model = model
        self._client_gone = client_gone
        self._output_filter = output_filter
        self._recorder = recorder
        if recorder is not None:
            on_chunk = _both(on_chunk, recorder.on_chunk)
        self._on_chunk = on_chunk
        self._admission: Admission | None = None
        self._relay: RelayStream | None = None
        self._quota_answered = asyncio.Event()

    async def open_stream(self) -> None:
        """Admit the request and open its decode stream (up to the first token). Errors
        raised here can still be HTTP statuses; they carry this request's headers."""
        with self._with_headers():
            admission = await self._admit()
            hooks = RelayHooks(
                on_output=admission.charge_output,
                before_last_event=self._settle,
                output_filter=self._output_filter,
                on_chunk=self._on_chunk,
            )
            self._relay = await self._pipeline.stream(
                self._endpoint, self._body, self.request, hooks
            )

    async def quota_answered(self) -> None:
        """Returns once the quota store has answered (the rate-limit headers are set) or
        admission ended otherwise; ``open_stream()`` must be running."""
        await self._quota_answered.wait()

    def events(self) -> AsyncIterator[str]:
        """The client's SSE payloads; ``open_stream()`` must have returned."""
        if self._relay is None:
            raise RuntimeError("Execution.events() before open_stream() completed")
        return self._relay.events()

    @property
    def stream_error(self) -> TandemError | None:
        """The error a started stream ended with (sent to the client as one event)."""
        return None if self._relay is None else self._relay.error

    async def complete(self) -> dict[str, Any]:
        """Serve a non-streaming request. With ``client_gone``, a client that hangs up stops
        the engine work (the upstream call is cancelled, so vLLM aborts it)."""
        try:
            with self._with_headers():
                await self._admit()
                serving = self._pipeline.complete(self._endpoint, self._body, self.request)
                if self._client_gone is None:
                    result = await serving
                else:
                    # Nobody reads the error if the client left; it is for logs and counters.
                    result = await unless_client_leaves(
                        serving,
                        self._client_gone,
                        "The client closed the connection before the answer.",
                    )
                if self._output_filter is not None:
                    await self._output_filter.filter_response(result)
                    if self._output_filter.blocked:
                        self.request.finish_reason = CONTENT_FILTER
                if self._recorder is not None:
                    self._recorder.on_result(result)
                return result
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Idempotent: drop the engine stream and settle whatever was admitted."""
        if self._relay is not None:
            await self._relay.aclose()
        await self._settle()

    async def _settle(self) -> None:
        """Settle the quota, then bill (each exactly once, whoever calls first)."""
        if self._admission is None:
            return
        await self._gate.settle(self._admission, self.request)
        if self._recorder is not None:
            self._recorder.record()

    async def _admit(self) -> Admission:
        try:
            self._admission = await self._gate.admit(
                self._caller, self._endpoint, self._body, self.request, self._model,
                self._client_gone, on_reserved=self._on_reserved,
            )  # fmt: skip
        finally:
            self._quota_answered.set()  # refused before the quota, or admitted: nothing to wait for
        queue_ms = round((self.request.queue_wait_s or 0.0) * 1000)
        self.headers["x-tandem-queue-ms"] = str(queue_ms)
        return self._admission

    def _on_reserved(self, ratelimit_headers: dict[str, str]) -> None:
        self.headers.update(ratelimit_headers)
        self._quota_answered.set()

    @contextmanager
    def _with_headers(self) -> Iterator[None]:
        """An error before the first byte still carries the request id and rate-limit
        headers."""
        try:
            yield
        except TandemError as exc:
            exc.extra_headers = {**self.headers, **exc.extra_headers}
            raise


def _both(
    first: Callable[[dict[str, Any]], None] | None, second: Callable[[dict[str, Any]], None]
) -> Callable[[dict[str, Any]], None]:
    if first is None:
        return second

    def call(chunk: dict[str, Any]) -> None:
        first(chunk)
        second(chunk)

    return call
