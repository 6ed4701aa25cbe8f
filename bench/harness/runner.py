"""Drive planned requests at their load shape and collect the records.

The load generator must not be the bottleneck it measures: one ``aiohttp`` session with no
connection cap, uvloop when available, the garbage collector frozen after set-up, and every
record says how late it was sent against its schedule (``schedule_lag`` in the summary).
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable, Sequence

import aiohttp

from bench.harness.client import TokenCount, send
from bench.harness.records import RequestRecord
from bench.harness.workload import PlannedRequest, Target

OnDone = Callable[[RequestRecord], None]


async def execute(
    target: Target,
    requests: Sequence[PlannedRequest],
    *,
    max_concurrency: int | None,
    count_tokens: TokenCount | None = None,
    on_done: OnDone | None = None,
) -> list[RequestRecord]:
    """Send ``requests`` at their offsets (closed loop when they have none), in plan order."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        gc.collect()
        gc.freeze()  # what exists now is never garbage; keeps collector pauses out of timings
        run_start = time.perf_counter()

        async def one(planned: PlannedRequest) -> RequestRecord:
            if planned.scheduled_s is not None:
                delay = run_start + planned.scheduled_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            record = RequestRecord(
                index=planned.index,
                tenant=planned.tenant.name,
                warmup=planned.warmup,
                scheduled_s=planned.scheduled_s,
                max_tokens=planned.prompt.output_tokens,
                expected_prompt_tokens=planned.prompt.tokens,
            )
            if slots is None:
                await send(session, target, planned, record, run_start, count_tokens)
            else:
                async with slots:
                    await send(session, target, planned, record, run_start, count_tokens)
            if on_done is not None:
                on_done(record)
            return record

        try:
            return list(await asyncio.gather(*(one(p) for p in requests)))
        finally:
            gc.unfreeze()
