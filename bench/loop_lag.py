"""How late a load generator's event loop wakes up: the part of a benchmark's figures that is the
client's own stall, not the system under test's."""

from __future__ import annotations

import asyncio
import contextlib

TICK_S = 0.01
"""The watched sleep: short enough to resolve a stall to ~10 ms, cheap at 100 wake-ups a second."""


class LoopLag:
    """Every ``TICK_S`` sleep's oversleep (seconds) between ``start`` and ``aclose``."""

    def __init__(self) -> None:
        self.lags_s: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="bench-loop-lag")

    async def aclose(self) -> None:
        """Stop watching (idempotent); ``lags_s`` keeps what was measured."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def longest_s(self) -> float:
        """The longest stretch the loop ran nothing else (0 when nothing was measured)."""
        return max(self.lags_s, default=0.0)

    def late_s(self, at_least_s: float = 0.1) -> float:
        """Seconds lost to stalls of at least ``at_least_s`` each (shorter ones are the loop's
        ordinary work)."""
        return sum(lag for lag in self.lags_s if lag >= at_least_s)

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(TICK_S)
            self.lags_s.append(loop.time() - before - TICK_S)
