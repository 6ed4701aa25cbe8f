"""Request deadlines: one per request, from the client's header or the gateway's default.

The deadline is absolute (``time.monotonic()``) and travels on the ``Request``: the queue wait,
the prefill leg, the wait for the first token and every read of the decode stream are bounded
by what is left of it, so an expired request ends with a 504 ``deadline_exceeded`` (or, once
streaming, one error event) instead of hanging; the engine request is aborted with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from core.errors import DeadlineExceededError, InvalidRequestError

TIMEOUT_HEADER = "x-tandem-timeout-ms"
"""Per-request deadline in milliseconds from arrival; at most the gateway's maximum."""


@dataclass(frozen=True, slots=True)
class DeadlineConfig:
    """How long requests may take, from arrival to their last byte."""

    default_s: float = 600.0
    """A request without the header."""
    max_s: float = 3600.0
    """The most a client may ask for with the header."""


def request_deadline(header: str | None, default_s: float, max_s: float) -> float:
    """The monotonic deadline for a request that arrived now; 400 on a malformed header."""
    timeout_s = default_s
    if header is not None:
        try:
            timeout_ms = float(header)
        except ValueError:
            timeout_ms = -1.0
        if not timeout_ms > 0 or timeout_ms == float("inf"):
            raise InvalidRequestError(
                f"{TIMEOUT_HEADER} must be a positive number of milliseconds, got {header!r}.",
                param=TIMEOUT_HEADER,
            )
        timeout_s = min(timeout_ms / 1000, max_s)
    return time.monotonic() + timeout_s


def deadline_error(where: str) -> DeadlineExceededError:
    return DeadlineExceededError(
        f"The request's deadline passed {where}; what was generated so far is billed. Send a "
        f"longer {TIMEOUT_HEADER}, or ask for fewer tokens."
    )


@asynccontextmanager
async def within_deadline(deadline: float | None, where: str) -> AsyncIterator[None]:
    """Bound the block by ``deadline`` (``time.monotonic()``; ``None``: unbounded); past it,
    the block is cancelled (an engine call in it is aborted) and ``DeadlineExceededError``
    raised. Never hold it across a ``yield``: the timeout would hit the consumer instead."""
    if deadline is None:
        yield
        return
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)) as scope:
            yield
    except TimeoutError as exc:
        if scope.expired():
            raise deadline_error(where) from exc
        raise
