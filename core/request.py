"""The one mutable per-request state object and its phase machine.

A request moves forward through ``RequestPhase`` only; steps that a path does not take (a
colocated request has no prefill leg) are skipped, never revisited. ``FINISHED``, ``FAILED`` and
``ABORTED`` are terminal: every request accepted by the gateway ends in exactly one of them.

Every change of phase, path or body goes through a method here, which refuses a change the
lifecycle does not allow (``PhaseError``: a bug in the caller, never a client error). The
gateway's flow (``gateway/serving/flow.py``) is the only caller that ends a request.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.messages import Endpoint, ServingPath, Usage
from core.models import ServedModel
from core.moderation import Action, ModerationDecision
from core.prompt import Prompt, TokenEstimate


class RequestPhase(enum.IntEnum):
    """Lifecycle phases in order (docs/ARCHITECTURE.md numbers them the same way)."""

    RECEIVED = 1
    AUTHENTICATED = 2
    MODERATED = 3
    ADMITTED = 4
    PREFILLING = 5
    KV_TRANSFERRING = 6
    DECODING = 7
    FINISHED = 8
    FAILED = 9
    ABORTED = 10

    @property
    def is_terminal(self) -> bool:
        return self >= RequestPhase.FINISHED


class PhaseError(RuntimeError):
    """A transition the phase machine forbids: a bug in the caller, not a client error."""


@dataclass(slots=True, eq=False)
class Request:
    """One client request inside the gateway: what was asked, and how far it got.

    Build it with ``Request.receive``, which reads the body once (the prompt view, ``stream``,
    ``include_usage``); every later reader uses those fields instead of the body.
    """

    request_id: str
    endpoint: Endpoint
    model: ServedModel
    """The served model the body's ``model`` resolved to."""
    body: dict[str, Any]
    """What the engine gets: the client's validated JSON, redacted by input moderation and
    given its output cap at admission (``redact``, ``cap_output``)."""
    prompt: Prompt
    """The body's prompt, parsed once: moderation, token counting, the decider and prefix
    affinity read it."""
    stream: bool = False
    include_usage: bool = False
    """The client asked for the usage chunk (``stream_options.include_usage``)."""
    tenant_id: str | None = None
    key_id: str | None = None
    """The API key the request came with (None for the anonymous tenant)."""
    deadline: float | None = None
    """``time.monotonic()`` by which the request must end; queue, legs and stream honour it."""
    created: int = field(default_factory=lambda: int(time.time()))
    phase: RequestPhase = RequestPhase.RECEIVED
    estimate: TokenEstimate | None = None
    """The most it may cost, counted at admission with the served model's tokenizer."""
    record_id: str | None = None
    """The ledger's key for this request when it is not the request id: the same for every
    run of an idempotent request, so it is billed once."""
    engine_ran: bool = False
    """A leg was sent to a worker: from then on the engine may have done work for it."""
    path: ServingPath | None = None
    path_reason: str | None = None  # why that path (kv_transfer.decider.Reason)
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_leg_s: float | None = None
    """Duration of the prefill leg (disaggregated requests only)."""
    kv_blocks: int | None = None
    """KV blocks the transfer handle offered the decode worker."""
    kv_bytes: int | None = None
    """Those blocks in bytes, where the model's KV geometry is known. The decode worker reads
    fewer when it already holds a prefix of the prompt."""
    decode_sent_at: float | None = None
    """When the decode leg (the one whose tokens reach the client) was sent."""
    queue_wait_s: float | None = None
    """Time spent waiting for admission in the fair queue."""
    prompt_kept: bool = False
    """The prompt is kept to the end (a tenant's request log stores it); else a stream lets
    go of it once it decodes (``let_go_of_prompt``)."""
    num_streamed_tokens: int = 0
    """Content chunks relayed to the client per choice (about one token each), for billing a
    stream that ended without the engine's usage."""
    usage: Usage | None = None
    """The engine's count: its final usage chunk, or the latest running count (vLLM's
    ``continuous_usage_stats``) when the stream was cut, so what was produced is billed."""
    usage_so_far: Callable[[], Usage | None] | None = field(default=None, repr=False)
    """Reads the engine's running count while a stream runs (``follow_usage``); the request
    keeps it as ``usage`` when it ends."""
    moderation: list[ModerationDecision] = field(default_factory=list)
    """Every moderation decision taken on this request (input and output, flags included)."""
    resolved_by: str | None = None
    """Why its model resolved to this version (``gateway.catalog.Resolved.reason``)."""
    finish_reason: str | None = None
    error_code: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_output_at: float | None = None
    longest_pause_s: float = 0.0
    """The longest gap between two consecutive output chunks: where an engine preemption (the
    request recomputed behind higher-priority work) or a stall shows."""
    finished_at: float | None = None

    @classmethod
    def receive(
        cls,
        request_id: str,
        endpoint: Endpoint,
        model: ServedModel,
        body: dict[str, Any],
        *,
        tenant_id: str | None = None,
        key_id: str | None = None,
        deadline: float | None = None,
    ) -> Request:
        """A request for ``body`` (validated against the endpoint's schema), read once."""
        stream_options = body.get("stream_options") or {}
        return cls(
            request_id=request_id,
            endpoint=endpoint,
            model=model,
            body=body,
            prompt=Prompt.parse(endpoint, body),
            stream=bool(body.get("stream")),
            include_usage=bool(stream_options.get("include_usage")),
            tenant_id=tenant_id,
            key_id=key_id,
            deadline=deadline,
        )

    # -- before admission: the body may still change --------------------------------------

    def redact(self, body: dict[str, Any]) -> None:
        """Input moderation rewrote the prompt: the engine gets ``body``, counted anew."""
        self._check_before(RequestPhase.ADMITTED, "redact")
        self.body = body
        self.prompt = Prompt.parse(self.endpoint, body)

    def cap_output(self, max_tokens: int) -> None:
        """Give a request that set no output cap the one admission chose for it."""
        self._check_before(RequestPhase.ADMITTED, "cap_output")
        self.body["max_tokens"] = max_tokens

    def set_engine_priority(self, priority: int | None) -> None:
        """The ``priority`` every leg carries to the engine (None: none, for workers without
        priority scheduling). The gateway decides it, never the client: a client's own
        ``priority`` is replaced or dropped."""
        self._check_before(RequestPhase.ADMITTED, "set_engine_priority")
        if priority is None:
            self.body.pop("priority", None)
        else:
            self.body["priority"] = priority

    def keep_prompt(self) -> None:
        """Keep the prompt to the end: a request log stores it with the answer."""
        self._check_before(RequestPhase.DECODING, "keep_prompt")
        self.prompt_kept = True

    def bill_as(self, record_id: str) -> None:
        """Bill every run of this request under ``record_id`` (an idempotency key's)."""
        self._check_before(RequestPhase.ADMITTED, "bill_as")
        self.record_id = record_id

    def record_moderation(self, decisions: list[ModerationDecision]) -> None:
        self._check_open(self.phase)
        self.moderation.extend(decisions)

    # -- admission -------------------------------------------------------------------------

    def record_estimate(self, estimate: TokenEstimate) -> None:
        """The token estimate admission reserves against (made once, before the queue)."""
        self._check_before(RequestPhase.ADMITTED, "record_estimate")
        self.estimate = estimate

    def admit(self, queue_wait_s: float) -> None:
        if self.estimate is None:
            raise PhaseError(f"request {self.request_id}: admitted without a token estimate")
        self.advance(RequestPhase.ADMITTED)
        self.queue_wait_s = queue_wait_s

    # -- routing and the legs --------------------------------------------------------------

    def route(
        self,
        path: ServingPath,
        reason: str,
        decode_worker: str,
        prefill_worker: str | None = None,
    ) -> None:
        """The path chosen for the request, and the workers it goes to (once)."""
        if self.phase is not RequestPhase.ADMITTED or self.path is not None:
            raise PhaseError(
                f"request {self.request_id}: routed in phase {self.phase.name} "
                f"(path {self.path}); a request is routed once, right after admission"
            )
        if (prefill_worker is None) == (path is ServingPath.DISAGGREGATED):
            raise PhaseError(f"request {self.request_id}: a {path} path with prefill worker "
                             f"{prefill_worker}")  # fmt: skip
        self.path, self.path_reason = path, reason
        self.decode_worker, self.prefill_worker = decode_worker, prefill_worker

    def fall_back(self, reason: str, decode_worker: str | None = None) -> None:
        """Serve it colocated after all (prefill failed, KV lost or expired, decode failed
        before its first byte), on ``decode_worker`` when that changes."""
        self._check_open(self.phase)
        if self.path is None or self.first_token_at is not None:
            raise PhaseError(
                f"request {self.request_id}: fall back before routing or after the first "
                "token (output already reached the client)"
            )
        self.path, self.path_reason = ServingPath.FALLBACK, reason
        if decode_worker is not None:
            self.decode_worker = decode_worker

    def leg_sent(self, *, decode: bool) -> None:
        """A leg went to a worker (``decode``: the one whose tokens reach the client)."""
        self._check_open(self.phase)
        if self.path is None:
            raise PhaseError(f"request {self.request_id}: a leg sent before routing")
        self.engine_ran = True
        if decode:
            self.decode_sent_at = time.monotonic()
        else:
            self.advance(RequestPhase.PREFILLING)

    def handed_off(self, prefill_leg_s: float, kv_blocks: int, kv_bytes: int | None) -> None:
        """Leg 1 returned a usable transfer handle; the decode worker will pull the KV."""
        if self.phase is not RequestPhase.PREFILLING:
            raise PhaseError(f"request {self.request_id}: KV handed off in {self.phase.name}")
        self.prefill_leg_s = prefill_leg_s
        self.kv_blocks, self.kv_bytes = kv_blocks, kv_bytes
        self.advance(RequestPhase.KV_TRANSFERRING)

    # -- output ----------------------------------------------------------------------------

    def count_output(self, num_tokens: int) -> None:
        """Content relayed to the client (about one token per choice and chunk)."""
        self._check_open(self.phase)
        self.num_streamed_tokens += num_tokens
        now = time.monotonic()
        if self.last_output_at is not None:
            self.longest_pause_s = max(self.longest_pause_s, now - self.last_output_at)
        self.last_output_at = now

    def follow_usage(self, usage_so_far: Callable[[], Usage | None]) -> None:
        """Where the engine's count so far is kept while a stream runs: read once, when the
        request ends (so a stream cut short bills what was produced), not built per chunk."""
        self._check_open(self.phase)
        self.usage_so_far = usage_so_far

    def let_go_of_prompt(self) -> None:
        """A stream that decodes holds its prompt's texts no longer (unless ``keep_prompt``):
        nothing sends its body again (a failed leg is re-run only before the stream opens; a
        shadow copied the body as it started), and a long prompt held for the whole
        generation was most of a stream's memory: 10.6 of 37.1 KiB of objects a stream with
        2,000-word prompts (``bench.overhead.memory_sites``). The body keeps its other fields."""
        if self.phase is not RequestPhase.DECODING or not self.stream:
            raise PhaseError(
                f"request {self.request_id}: let_go_of_prompt in phase {self.phase.name} "
                f"({'a stream' if self.stream else 'not a stream'}): only a decoding stream may"
            )
        if self.prompt_kept:
            return
        param = self.prompt.param
        self.body = {name: value for name, value in self.body.items() if name != param}
        self.prompt = self.prompt.without_texts()

    def mark_first_token(self) -> None:
        """Record the time the first output token left for the client (TTFT)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

    # -- the end (exactly one of these) ----------------------------------------------------

    def finish(self, finish_reason: str | None, usage: Usage | None) -> None:
        """The request completed; ``usage`` is the engine's count (None if it sent none)."""
        self._end(RequestPhase.FINISHED)
        self.finish_reason = finish_reason
        self.usage = usage or self.usage

    def fail(self, error_code: str | None) -> None:
        """The request ended with an error the client was sent."""
        self._end(RequestPhase.FAILED)
        self.error_code = error_code

    def abort(self) -> None:
        """The client went away before the request ended."""
        self._end(RequestPhase.ABORTED)

    def advance(self, phase: RequestPhase) -> None:
        """Move forward to non-terminal ``phase``; skipping phases is allowed, going back is not."""
        if phase.is_terminal:
            raise PhaseError(f"use finish/fail/abort to end a request, not advance({phase.name})")
        self._check_open(phase)
        if phase <= self.phase:
            raise PhaseError(
                f"request {self.request_id}: cannot go from {self.phase.name} to {phase.name}"
            )
        self.phase = phase

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (negative once passed); None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    @property
    def response_id(self) -> str:
        """The id clients see: the gateway's request id, the same on every chunk and retry."""
        prefix = "chatcmpl" if self.endpoint is Endpoint.CHAT else "cmpl"
        return f"{prefix}-{self.request_id}"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    @property
    def decode_first_token_s(self) -> float | None:
        """From the decode leg sent to its first token relayed: on a disaggregated request the
        KV hand-off (transfer and first decode step), on a colocated one the whole prefill."""
        if self.first_token_at is None or self.decode_sent_at is None:
            return None
        return self.first_token_at - self.decode_sent_at

    @property
    def output_tokens(self) -> int:
        """What it produced: the engine's count, else the content chunks relayed (a stream
        cut before the engine's usage)."""
        return self.usage.completion_tokens if self.usage else self.num_streamed_tokens

    @property
    def input_tokens(self) -> int:
        """Its prompt: the engine's count, else admission's estimate (0 before admission)."""
        if self.usage is not None:
            return self.usage.prompt_tokens
        return self.estimate.prompt_tokens if self.estimate is not None else 0

    @property
    def moderation_action(self) -> str | None:
        """The strictest moderation action taken on it; None when everything was allowed."""
        taken = [d.action for d in self.moderation if d.action is not Action.ALLOW]
        return max(taken, key=lambda action: action.severity).value if taken else None

    @property
    def itl_s(self) -> float | None:
        """Mean time between output tokens of a stream after its first (vLLM's TPOT)."""
        if (
            self.first_token_at is None
            or self.finished_at is None
            or not self.stream
            or self.num_streamed_tokens < 2
        ):
            return None
        return (self.finished_at - self.first_token_at) / (self.num_streamed_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def _end(self, phase: RequestPhase) -> None:
        self._check_open(phase)
        if self.usage_so_far is not None:
            self.usage = self.usage_so_far() or self.usage
            self.usage_so_far = None
        self.phase = phase
        self.finished_at = time.monotonic()

    def _check_before(self, limit: RequestPhase, action: str) -> None:
        if self.phase >= limit:
            raise PhaseError(
                f"request {self.request_id}: {action} in phase {self.phase.name}, "
                f"allowed only before {limit.name}"
            )

    def _check_open(self, target: RequestPhase) -> None:
        if self.phase.is_terminal:
            raise PhaseError(
                f"request {self.request_id} already ended as {self.phase.name}; "
                f"cannot move to {target.name}"
            )
