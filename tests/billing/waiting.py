"""Bounded waits for the billing package's background work (the flusher, the refresher)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    """Until ``predicate()`` holds; a hang guard, never a timing assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting after {timeout_s} s for: {what}")
        await asyncio.sleep(0.01)


async def returns(call: Awaitable[None], what: str, timeout_s: float = 20.0) -> None:
    """Await ``call`` with a hang guard (a lost cancellation would wait for the whole interval;
    ``asyncio.timeout`` cannot bound it: the awaited ``aclose`` suppresses CancelledError)."""
    task = asyncio.ensure_future(call)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    assert done, f"{what} did not return within {timeout_s} s: a cancellation was lost"
    await task
