"""The serving pipeline: the one place that knows the whole flow of a request.

    validated body -> pick decode (+ prefill) worker -> leg 1: prefill, KV kept for remote decode
    -> leg 2: decode pulls the KV over NIXL and generates -> relay to the client -> finish

The engine is always asked for usage (billing and quotas need it); the usage chunk reaches the
client only when it asked (``stream_options.include_usage``). Response ids and ``created`` are the
gateway's, so they stay the same across legs and workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from core.errors import (
    EngineError,
    EngineTimeoutError,
    ModelNotFoundError,
    NoHealthyWorkerError,
    TandemError,
)
from core.messages import Endpoint, ServingPath, Usage
from core.request import Request, RequestPhase
from gateway.deadlines import within_deadline
from gateway.metrics import GatewayMetrics
from gateway.relay import RelayHooks, RelayStream, log_request_end, response_id
from gateway.upstream import EngineClient, EngineStream
from kv_transfer.affinity import prefix_key
from kv_transfer.decider import DeciderConfig, Reason, decide
from kv_transfer.geometry import KvGeometry
from kv_transfer.handle import TransferHandle
from kv_transfer.legs import colocated_body, decode_leg_body, prefill_leg_body
from workers.registry import Worker, WorkerSource, least_loaded, pick_by_affinity

log = logging.getLogger("tandem.requests")

T = TypeVar("T")

# How long a client is told to wait when no worker is healthy: about one health-poll round
# plus a worker restart's first backoff step.
_NO_WORKER_RETRY_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model the gateway serves, as ``/v1/models`` lists it."""

    name: str
    max_model_len: int | None
    created: int
    version: str | None = None
    """The exact weights served (price cards and measured cost are keyed by it); None: the
    name."""
    deployment: str = "default"
    """The deployment serving it (a rollout arm, in time)."""
    default_max_tokens: int | None = None
    """The output cap of a chat request that sets none (a plan's ``max_output_tokens`` wins);
    None: up to the context window, as OpenAI's API. See ``output_cap``."""
    kv_geometry: KvGeometry | None = None
    """Bytes per KV block on its workers, to count what each transfer hands over; None when
    the model's shape is not known (external workers without a model folder)."""

    @property
    def output_cap(self) -> int | None:
        """``default_max_tokens``, within the context window."""
        if self.default_max_tokens is None:
            return None
        return self.within_window(self.default_max_tokens)

    def within_window(self, max_tokens: int) -> int:
        """``max_tokens`` no longer than the context window: the engine refuses a larger one
        (it shortens one that only the prompt pushes past the window)."""
        return max_tokens if self.max_model_len is None else min(max_tokens, self.max_model_len)


class ServingPipeline:
    """Runs requests across the prefill and decode pools."""

    def __init__(
        self,
        engine: EngineClient,
        prefill: WorkerSource,
        decode: WorkerSource,
        models: Sequence[ServedModel],
        decider: DeciderConfig,
        metrics: GatewayMetrics,
    ) -> None:
        self._engine = engine
        self._prefill = prefill
        self._decode = decode
        self._decider = decider
        self._metrics = metrics
        self.models = tuple(models)
        self._models_by_name = {model.name: model for model in models}

    def check_model(self, name: str) -> ServedModel:
        """The served model of that name, or 404."""
        model = self._models_by_name.get(name)
        if model is None:
            served = ", ".join(sorted(self._models_by_name))
            raise ModelNotFoundError(
                f"The model '{name}' does not exist on this server; served models: {served}",
                param="model",
            )
        return model

    def check_decode_available(self) -> None:
        """503 at once when no decode worker is healthy: better than a long wait in the
        admission queue for a worker that may take minutes to come back."""
        _pick(self._decode, "decode")  # the same check and error as routing's

    async def complete(
        self, endpoint: Endpoint, body: dict[str, Any], request: Request
    ) -> dict[str, Any]:
        """Serve a non-streaming request and return the client's JSON body."""

        async def call(worker: Worker, leg: dict[str, Any]) -> dict[str, Any]:
            leg["stream"] = False
            with worker.lease():
                return await self._engine.post_json(
                    worker, endpoint, leg, request.request_id, prefill=False
                )

        with self._ended_on_error(request):
            async with within_deadline(request.deadline, "before the answer was complete"):
                # A timed-out non-streaming answer is not retried: that would double the wait.
                _, response = await self._decode_with_retry(
                    endpoint, body, request, call, retry_timeouts=False
                )
        response.pop("kv_transfer_params", None)
        response["id"] = response_id(endpoint, request)
        response["created"] = request.created
        choices = response.get("choices") or [{}]
        request.mark_first_token()
        request.finish(choices[0].get("finish_reason"), _usage(response))
        self._observe_end(request)
        return response

    async def stream(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        request: Request,
        hooks: RelayHooks | None = None,
    ) -> RelayStream:
        """Open the decode stream; the caller relays it and must ``aclose()`` it.

        Everything that can fail before the first byte (routing, the prefill leg, the decode
        worker refusing) raises here, so the client gets a real HTTP error status.
        ``hooks`` (charging, settlement, output moderation, recording) act on the relay.
        """

        async def call(worker: Worker, leg: dict[str, Any]) -> EngineStream:
            # Usage on every chunk too: a stream cut short (client gone, deadline, content
            # filter) is billed from the engine's own count of what it produced.
            leg["stream_options"] = {
                **(body.get("stream_options") or {}),
                "include_usage": True,
                "continuous_usage_stats": True,
            }
            with worker.lease():
                return await self._engine.open_stream(worker, endpoint, leg, request.request_id)

        with self._ended_on_error(request):
            async with within_deadline(request.deadline, "before the first token"):
                # A first byte that never comes is a stalled KV transfer: re-run colocated.
                decode_worker, upstream = await self._decode_with_retry(
                    endpoint, body, request, call, retry_timeouts=True
                )
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return RelayStream(
            upstream, decode_worker, request, endpoint, include_usage, self._observe_end,
            hooks or RelayHooks(),
        )  # fmt: skip

    async def _decode_with_retry(
        self,
        endpoint: Endpoint,
        body: dict[str, Any],
        request: Request,
        call: Callable[[Worker, dict[str, Any]], Awaitable[T]],
        *,
        retry_timeouts: bool,
    ) -> tuple[Worker, T]:
        """Run the decode leg; if it fails before any byte reached the client, run the request
        once more, colocated, on another decode worker when there is one.

        The first attempt may have been a KV transfer that could not complete (prefill worker
        gone, stalled transfer) or a decode worker that just died; nothing was sent to the
        client yet, so a retry cannot duplicate output.
        """
        decode_worker, leg, kv_source = await self._prepare_decode(endpoint, body, request)
        if not request.stream:
            request.advance(RequestPhase.DECODING)
        try:
            request.decode_sent_at = time.monotonic()
            attempt = call(decode_worker, leg)
            if kv_source is not None:
                attempt = _unless_worker_lost(attempt, kv_source, self._decider.kv_source_check_s)
            return decode_worker, await attempt
        except EngineError as exc:
            if isinstance(exc, EngineTimeoutError) and not retry_timeouts:
                raise
            reason = (
                Reason.PREFILL_LOST if isinstance(exc, KvSourceLostError) else Reason.DECODE_FAILED
            )
            retry_worker = _pick_other(self._decode, decode_worker) or decode_worker
            log.warning(
                "request %s: decode on %s failed before the first byte (%s); re-running it "
                "colocated on %s", request.request_id, decode_worker.name, exc.message,
                retry_worker.name,
            )  # fmt: skip
        request.path, request.path_reason = ServingPath.FALLBACK, reason
        request.decode_worker = retry_worker.name
        request.decode_sent_at = time.monotonic()
        return retry_worker, await call(retry_worker, colocated_body(body))

    async def _prepare_decode(
        self, endpoint: Endpoint, body: dict[str, Any], request: Request
    ) -> tuple[Worker, dict[str, Any], Worker | None]:
        """Pick workers, run the prefill leg when disaggregating; return the decode worker, its
        leg and the prefill worker holding the leg's KV (None when colocated).

        A prefill side that is down or fails (5xx, unreachable, timeout) is not the client's
        problem: the request falls back to colocated serving on the decode worker. A 400 from
        the prefill worker is about the request and reaches the client.
        """
        decode_worker = _pick(self._decode, "decode")
        request.decode_worker = decode_worker.name
        prefill_workers = self._prefill.workers
        decision = decide(
            body,
            self._decider,
            has_prefill_pool=bool(prefill_workers),
            prefill_healthy=any(worker.healthy for worker in prefill_workers),
        )
        request.path, request.path_reason = decision.path, decision.reason
        if decision.path is not ServingPath.DISAGGREGATED:
            return decode_worker, colocated_body(body), None
        # Only split requests pay for the affinity key. No await since the health check above,
        # so a healthy prefill worker is still there.
        prefill_worker = pick_by_affinity(
            prefill_workers,
            prefix_key(body, self._decider.affinity_prefix_chars),
            self._decider.affinity_max_extra_load,
        )
        if prefill_worker is None:
            raise RuntimeError("decide() saw a healthy prefill worker that pick found gone")
        request.prefill_worker = prefill_worker.name
        request.advance(RequestPhase.PREFILLING)
        started = time.monotonic()
        try:
            with prefill_worker.lease():
                prefilled = await self._engine.post_json(
                    prefill_worker, endpoint, prefill_leg_body(body), request.request_id,
                    prefill=True,
                )  # fmt: skip
            handle = TransferHandle.from_prefill_response(
                prefilled, prefill_worker.name, lease_s=self._decider.kv_lease_s
            )
        except EngineError as exc:
            log.warning(
                "request %s: prefill on %s failed (%s); serving it colocated on %s",
                request.request_id, prefill_worker.name, exc.message, decode_worker.name,
            )  # fmt: skip
            request.path, request.path_reason = ServingPath.FALLBACK, Reason.PREFILL_FAILED
            return decode_worker, colocated_body(body), None
        request.prefill_leg_s = time.monotonic() - started
        if handle.expired():
            log.warning(
                "request %s: the KV on %s expired before leg 2; serving it colocated on %s",
                request.request_id, prefill_worker.name, decode_worker.name,
            )  # fmt: skip
            request.path, request.path_reason = ServingPath.FALLBACK, Reason.KV_EXPIRED
            return decode_worker, colocated_body(body), None
        request.kv_blocks = handle.num_blocks
        served = self._models_by_name.get(request.model)
        geometry = served.kv_geometry if served else None
        if geometry is not None:
            request.kv_bytes = geometry.bytes_of(handle.num_blocks)
        # The decode worker pulls the KV when it schedules leg 2; the phase records the hand-off.
        request.advance(RequestPhase.KV_TRANSFERRING)
        return decode_worker, decode_leg_body(body, handle), prefill_worker

    def _observe_end(self, request: Request) -> None:
        log_request_end(request)
        self._metrics.observe_end(request)

    @contextmanager
    def _ended_on_error(self, request: Request) -> Iterator[None]:
        """End ``request`` in the right terminal phase if the block raises, then re-raise."""
        try:
            yield
        except TandemError as exc:
            request.fail(exc.code)
            log.warning("request %s failed: %s (%s)", request.request_id, exc.message, exc.code)
            self._metrics.observe_end(request)
            raise
        except asyncio.CancelledError:
            request.abort()
            log.info("request %s aborted: the client went away", request.request_id)
            self._metrics.observe_end(request)
            raise
        except Exception:
            # A bug: the client gets the catch-all 500 from gateway/errors.py; count it as failed.
            request.fail("internal_error")
            self._metrics.observe_end(request)
            raise


def _pick(pool: WorkerSource, role: str) -> Worker:
    worker = pool.pick()
    if worker is None:
        raise NoHealthyWorkerError(
            f"No healthy {role} worker is available; retry shortly.",
            retry_after_s=_NO_WORKER_RETRY_AFTER_S,
        )
    return worker


class KvSourceLostError(EngineError):
    """The prefill worker holding a decode leg's KV went down before the leg answered."""


async def _unless_worker_lost(attempt: Awaitable[T], kv_source: Worker, check_s: float) -> T:
    """``attempt``, unless ``kv_source`` leaves rotation first: then it is cancelled (closing
    the connection aborts the decode worker's request) and ``KvSourceLostError`` raised.

    A decode worker reading KV from a dead peer gives up on its own only after its NIXL
    timeouts (seen here: 20 ms to 108 s); the gateway knows sooner, from its health checks or
    the worker's process exit, and can re-run the request colocated at once.
    """
    task = asyncio.ensure_future(attempt)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=check_s)
            if done:
                return task.result()
            if not kv_source.healthy:
                raise KvSourceLostError(
                    f"prefill worker {kv_source.name} went down before the decode worker "
                    "read its KV"
                )
    finally:
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError, EngineError):
                await task


def _pick_other(pool: WorkerSource, failed: Worker) -> Worker | None:
    """The least-loaded healthy worker other than ``failed``, if any."""
    return least_loaded(worker for worker in pool.workers if worker is not failed)


def _usage(response: dict[str, Any]) -> Usage | None:
    usage = response.get("usage")
    return Usage.from_openai(usage) if isinstance(usage, dict) else None
