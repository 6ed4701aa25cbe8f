"""The one mutable per-request state object and its phase machine.

A request moves forward through ``RequestPhase`` only; steps that a path does not take (a
colocated request has no prefill leg) are skipped, never revisited. ``FINISHED``, ``FAILED`` and
``ABORTED`` are terminal: every request accepted by the gateway ends in exactly one of them.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from core.messages import ServingPath, Usage
from core.moderation import ModerationDecision


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


@dataclass(slots=True)
class Request:
    """State of one client request inside the gateway."""

    request_id: str
    model: str
    stream: bool
    created: int = field(default_factory=lambda: int(time.time()))
    phase: RequestPhase = RequestPhase.RECEIVED
    path: ServingPath | None = None
    path_reason: str | None = None  # why that path (kv_transfer.decider.Reason)
    prefill_worker: str | None = None
    decode_worker: str | None = None
    tenant_id: str | None = None
    key_id: str | None = None
    """The API key the request came with (None for the anonymous tenant)."""
    record_id: str | None = None
    """The ledger's key for this request when it is not the request id: the same for every
    run of an idempotent request, so it is billed once."""
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
    num_streamed_tokens: int = 0
    """Content chunks relayed to the client per choice (about one token each), for billing a
    stream that ended without the engine's usage."""
    usage: Usage | None = None
    """The engine's count: its final usage chunk, or the latest running count (vLLM's
    ``continuous_usage_stats``) when the stream was cut, so what was produced is billed."""
    deadline: float | None = None
    """``time.monotonic()`` by which the request must end; queue, legs and stream honour it."""
    moderation: list[ModerationDecision] = field(default_factory=list)
    """Every moderation decision taken on this request (input and output, flags included)."""
    finish_reason: str | None = None
    error_code: str | None = None
    started_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None

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

    def mark_first_token(self) -> None:
        """Record the time the first output token left for the client (TTFT)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()

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

    def remaining_s(self) -> float | None:
        """Seconds left before the deadline (negative once passed); None without one."""
        return None if self.deadline is None else self.deadline - time.monotonic()

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
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def _end(self, phase: RequestPhase) -> None:
        self._check_open(phase)
        self.phase = phase
        self.finished_at = time.monotonic()

    def _check_open(self, target: RequestPhase) -> None:
        if self.phase.is_terminal:
            raise PhaseError(
                f"request {self.request_id} already ended as {self.phase.name}; "
                f"cannot move to {target.name}"
            )
