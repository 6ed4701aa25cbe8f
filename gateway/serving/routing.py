"""Routing and the engine legs: which workers serve a request, and the calls made to them.

    route(): pick the decode worker, decide the path, pick the prefill worker (prefix affinity)
    prefill(): leg 1 on the prefill worker, KV kept for remote decode -> a transfer handle
    decode(): leg 2 on the decode worker (pulling the KV over NIXL), up to its first byte; a
              leg that fails before any byte reached the client is re-run once, colocated

Each step returns a value and records what it did on the ``Request`` through its methods; the
flow (``gateway/serving/flow.py``) calls them in order and owns how the request ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from core.errors import EngineError, EngineTimeoutError, NoHealthyWorkerError
from core.messages import ServingPath, Usage
from core.request import Request, RequestPhase
from gateway.serving.upstream import EngineClient, EngineStream
from kv_transfer.affinity import prefix_key
from kv_transfer.decider import DeciderConfig, Reason, decide
from kv_transfer.handle import TransferHandle
from kv_transfer.legs import colocated_body, decode_leg_body, prefill_leg_body
from telemetry.request_trace import NO_LEG, NO_TRACE, LegSpan, RequestTrace
from workers.deployments import Deployment, Deployments
from workers.registry import Worker, WorkerSource, least_loaded, pick_by_affinity

log = logging.getLogger("tandem.requests")

T = TypeVar("T")

FALLBACK_REASON = "tandem.fallback.reason"
"""On a failed leg's span: why the request went on colocated."""
RETRY_REASON = "tandem.retry.reason"
"""On a re-run decode leg's span: why it was re-run."""

# How long a client is told to wait when no worker is healthy: about one health-poll round
# plus a worker restart's first backoff step.
_NO_WORKER_RETRY_AFTER_S = 5.0


@dataclass(frozen=True, slots=True)
class Route:
    """The workers a request goes to, all of its version's deployment."""

    deployment: Deployment
    decode: Worker
    prefill: Worker | None
    """The prefill worker of a disaggregated request; None when it runs colocated."""


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """The decode leg, answered: its worker and either the open stream or the whole answer."""

    worker: Worker
    stream: EngineStream | None = None
    answer: dict[str, Any] | None = None
    span: LegSpan = NO_LEG
    """The leg's trace span: a stream's ends with the stream (the flow ends it)."""


class Router:
    """Routes requests across their version's prefill and decode pools and runs their legs."""

    def __init__(
        self,
        engine: EngineClient,
        deployments: Deployments,
        decider: DeciderConfig,
        kv_lease_s: float,
        on_no_decode: Callable[[str], bool] = lambda version: False,
    ) -> None:
        """``kv_lease_s``: how long prefill workers keep KV nobody read (their connector's
        ``kv_lease_duration``); a handle older than that is not sent to a decode worker.
        ``on_no_decode(version)``: a request found the version without a decode worker in
        rotation; True when one is on its way (the planner was woken to start it)."""
        self._engine = engine
        self._deployments = deployments
        self._decider = decider
        self._kv_lease_s = kv_lease_s
        self._on_no_decode = on_no_decode

    def deployment(self, request: Request) -> Deployment:
        """The deployment of the request's version; 503 once it was undeployed."""
        deployment = self._deployments.get(request.model.version_name)
        if deployment is None:
            raise NoHealthyWorkerError(
                f"The model version {request.model.version_name} is no longer deployed; "
                "retry to be routed to a live one.",
                retry_after_s=1.0,
            )
        return deployment

    def check_decode_available(self, request: Request) -> None:
        """503 at once when the request's version has no decode worker in rotation: better than
        a long wait in the admission queue for a worker that may take minutes to come back.
        Unless the planner can start one (``on_no_decode`` says so, and was told): a pool scaled
        to zero waits in the queue, with heartbeats, while a worker boots."""
        deployment = self.deployment(request)
        if deployment.decode.pick() is None and not self._on_no_decode(deployment.version):
            raise _no_worker("decode")  # the same error as routing's

    def route(self, request: Request) -> Route:
        """Pick the decode worker of the request's version, decide the path, and for a split
        request its prefill worker of the same version (the one the prompt's prefix hashes
        to, for vLLM's prefix cache): KV never crosses versions."""
        deployment = self.deployment(request)
        decode_worker = _pick(deployment.decode, "decode")
        prefill_workers = deployment.prefill.workers
        assert request.estimate is not None  # admission counted the prompt
        decision = decide(
            request.estimate.prompt_tokens,
            request.estimate.num_choices,
            self._decider,
            # Workers all leaving are a pool scaled to zero, not one gone wrong.
            has_prefill_pool=any(not worker.draining for worker in prefill_workers),
            prefill_healthy=any(worker.in_rotation for worker in prefill_workers),
            decode_in_flight=decode_worker.num_outstanding,
        )
        prefill_worker = None
        if decision.path is ServingPath.DISAGGREGATED:
            # Only split requests pay for the affinity key. No await since the health check
            # above, so a healthy prefill worker is still there.
            prefill_worker = pick_by_affinity(
                prefill_workers,
                prefix_key(request.prompt, self._decider.affinity_prefix_chars),
                self._decider.affinity_max_extra_load,
            )
            if prefill_worker is None:
                raise RuntimeError("decide() saw a healthy prefill worker that pick found gone")
        request.route(
            decision.path,
            decision.reason,
            decode_worker.name,
            None if prefill_worker is None else prefill_worker.name,
        )
        return Route(deployment, decode_worker, prefill_worker)

    async def prefill(
        self, request: Request, prefill_worker: Worker, trace: RequestTrace = NO_TRACE
    ) -> TransferHandle | None:
        """Leg 1: the handle of the KV it computed, or None when the request falls back to
        colocated serving.

        A prefill side that fails (5xx, unreachable, timeout) or whose KV lease ran out is not
        the client's problem: the decode worker serves the request alone. A 400 from the
        prefill worker is about the request and reaches the client.
        """
        request.leg_sent(decode=False)
        started = time.monotonic()
        span = trace.leg("tandem.prefill", prefill_worker.name)
        try:
            with prefill_worker.lease():
                prefilled = await self._engine.post_json(
                    prefill_worker, request.endpoint, prefill_leg_body(request.body),
                    request.request_id, prefill=True, headers=span.headers,
                )  # fmt: skip
            handle = TransferHandle.from_prefill_response(
                prefilled, prefill_worker.name, lease_s=self._kv_lease_s
            )
        except EngineError as exc:
            log.warning(
                "request %s: prefill on %s failed (%s); serving it colocated on %s",
                request.request_id, prefill_worker.name, exc.message, request.decode_worker,
            )  # fmt: skip
            span.end(error=exc, attributes={FALLBACK_REASON: str(Reason.PREFILL_FAILED)})
            request.fall_back(Reason.PREFILL_FAILED)
            return None
        except BaseException as exc:
            span.end(error=exc)
            raise
        if handle.expired():
            log.warning(
                "request %s: the KV on %s expired before leg 2; serving it colocated on %s",
                request.request_id, prefill_worker.name, request.decode_worker,
            )  # fmt: skip
            span.end(attributes={FALLBACK_REASON: str(Reason.KV_EXPIRED)})
            request.fall_back(Reason.KV_EXPIRED)
            return None
        span.end(attributes={"tandem.kv.blocks": handle.num_blocks})
        # The decode worker pulls the KV when it schedules leg 2; the phase records the hand-off.
        request.handed_off(
            time.monotonic() - started, handle.num_blocks, request.model.kv_bytes(handle.num_blocks)
        )
        return handle

    async def decode(
        self,
        request: Request,
        route: Route,
        handle: TransferHandle | None,
        trace: RequestTrace = NO_TRACE,
    ) -> DecodeLeg:
        """Leg 2, up to its first byte (streams) or its whole answer.

        If it fails before any byte reached the client, the request runs once more, colocated,
        on another decode worker when there is one: the first attempt may have been a KV
        transfer that could not complete (prefill worker gone, stalled transfer) or a decode
        worker that just died; nothing was sent yet, so a retry cannot duplicate output. A
        timed-out non-streaming answer is not retried: that would double the wait.
        """
        call = self._open_stream if request.stream else self._answer
        leg = (
            colocated_body(request.body)
            if handle is None
            else decode_leg_body(request.body, handle)
        )
        worker = route.decode
        if not request.stream:
            request.advance(RequestPhase.DECODING)
        span = trace.leg("tandem.decode", worker.name)
        try:
            request.leg_sent(decode=True)
            attempt = call(request, worker, leg, span)
            if handle is not None and route.prefill is not None:
                attempt = _unless_worker_lost(
                    attempt, route.prefill, self._decider.kv_source_check_s
                )
                # A draining prefill worker is stopped only once its KV has been read.
                with route.prefill.holding_kv():
                    return await attempt
            return await attempt
        except EngineError as exc:
            if isinstance(exc, EngineTimeoutError) and not request.stream:
                span.end(error=exc)
                raise
            reason = (
                Reason.PREFILL_LOST if isinstance(exc, KvSourceLostError) else Reason.DECODE_FAILED
            )
            span.end(error=exc, attributes={FALLBACK_REASON: str(reason)})
            retry_worker = _pick_other(route.deployment.decode, worker) or worker
            log.warning(
                "request %s: decode on %s failed before the first byte (%s); re-running it "
                "colocated on %s", request.request_id, worker.name, exc.message,
                retry_worker.name,
            )  # fmt: skip
        except BaseException as exc:
            span.end(error=exc)
            raise
        request.fall_back(reason, retry_worker.name)
        request.leg_sent(decode=True)
        span = trace.leg("tandem.decode", retry_worker.name, {RETRY_REASON: str(reason)})
        try:
            return await call(request, retry_worker, colocated_body(request.body), span)
        except BaseException as exc:
            span.end(error=exc)
            raise

    async def _open_stream(
        self, request: Request, worker: Worker, leg: dict[str, Any], span: LegSpan
    ) -> DecodeLeg:
        # Usage on every chunk too: a stream cut short (client gone, deadline, content
        # filter) is billed from the engine's own count of what it produced.
        leg["stream_options"] = {
            **(request.body.get("stream_options") or {}),
            "include_usage": True,
            "continuous_usage_stats": True,
        }
        with worker.lease():
            stream = await self._engine.open_stream(
                worker, request.endpoint, leg, request.request_id, span.headers
            )
        span.first_token()
        return DecodeLeg(worker, stream=stream, span=span)

    async def _answer(
        self, request: Request, worker: Worker, leg: dict[str, Any], span: LegSpan
    ) -> DecodeLeg:
        leg["stream"] = False
        with worker.lease():
            answer = await self._engine.post_json(
                worker, request.endpoint, leg, request.request_id, prefill=False,
                headers=span.headers,
            )  # fmt: skip
        span.end()
        answer.pop("kv_transfer_params", None)
        answer["id"] = request.response_id
        answer["model"] = request.model.version_name
        answer["created"] = request.created
        return DecodeLeg(worker, answer=answer)


def answer_usage(answer: dict[str, Any]) -> Usage | None:
    """The engine's usage in a non-streaming answer."""
    usage = answer.get("usage")
    return Usage.from_openai(usage) if isinstance(usage, dict) else None


def _pick(pool: WorkerSource, role: str) -> Worker:
    worker = pool.pick()
    if worker is None:
        raise _no_worker(role)
    return worker


def _no_worker(role: str) -> NoHealthyWorkerError:
    return NoHealthyWorkerError(
        f"No healthy {role} worker is available; retry shortly.",
        retry_after_s=_NO_WORKER_RETRY_AFTER_S,
    )


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
    """The least-loaded healthy worker other than ``failed`` (under the KV watermark when one
    is), if any."""
    return least_loaded((w for w in pool.workers if w is not failed), pool.kv_watermark)
