"""One level of closed-loop load against one target, through the benchmark harness.

A level is a warm-up (``max(concurrency, 5)`` requests by default, its figures discarded) and a
measured phase whose size comes from the warm-up's throughput, so each level runs about
``duration_s`` whatever the target's speed. CPU readings bracket the measured phase only.

The measured phase is a paced closed loop: request k is due at ``k * L / (N * 1.1)`` (L: the
warm-up's median end-to-end time, N: the concurrency), i.e. 10% faster than N streams of length
L can turn over, and it goes out once it is due and one of the N slots is free. So arrivals are
smooth and the N slots stay busy. Started together, N identical fake streams would stay
phase-locked for the whole run: N requests arriving in the same millisecond once per stream
length and N chunks per token tick, which measures a burst the server queues, not its steady
state. (Spreading only the first N over L was tried: the slots freed before L then refilled all
at once at L, the same burst later.) ``LoadSpec.stagger=False`` keeps the burst.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from bench.harness.dataset import Prompt
from bench.harness.runner import execute
from bench.harness.summary import Slos, summarize
from bench.harness.workload import PlannedRequest, Target, TenantSpec
from bench.overhead.measure import CpuWindow, LevelResult, core_busy, count_chunks

CpuReader = Callable[[], tuple[float, float]]
"""User and system CPU seconds so far."""
RssReader = Callable[[], int]
"""The server's resident bytes now (``Server.rss_bytes``)."""
RSS_SAMPLE_S = 0.05

_FILLER_TEXT = (
    "the quick brown fox jumps over the lazy dog while a gateway relays every token it hears "
    "from the engine to the client without delay"
)
_FILLER = _FILLER_TEXT.split(" ")


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What every request of a level looks like and how long the level runs."""

    prompt_words: int = 100
    num_tokens: int = 32
    """``max_tokens`` per request (the fake streams exactly that many tokens)."""
    duration_s: float = 15.0
    """Target length of the measured phase."""
    min_requests: int = 10
    max_requests: int = 20_000
    warmup_requests: int | None = None
    """None: ``max(concurrency, 5)``."""
    stagger: bool = True
    """Pace the arrivals instead of starting all streams together (see the module docstring)."""


def prompt_text(index: int, num_words: int) -> str:
    """A prompt of ``num_words`` words, distinct per request from its first word on."""
    words = [f"request-{index}"]
    words += [_FILLER[k % len(_FILLER)] for k in range(max(0, num_words - 1))]
    return " ".join(words)


def plan(
    num_requests: int,
    spec: LoadSpec,
    tenant: TenantSpec,
    *,
    warmup: bool,
    first_index: int = 0,
    offsets: list[float | None] | None = None,
) -> list[PlannedRequest]:
    """Closed-loop requests: each is sent when a concurrency slot frees (and not before its
    offset, when ``offsets`` gives one)."""
    return [
        PlannedRequest(
            index=i,
            tenant=tenant,
            prompt=Prompt(
                text=prompt_text(i, spec.prompt_words),
                tokens=spec.prompt_words,
                output_tokens=spec.num_tokens,
            ),
            warmup=warmup,
            scheduled_s=offsets[i - first_index] if offsets else None,
        )
        for i in range(first_index, first_index + num_requests)
    ]


PACE_MARGIN = 1.1
"""Arrivals are paced this much faster than the slots turn over, so the slots stay full."""


def staggered_offsets(num_requests: int, concurrency: int, stream_s: float) -> list[float | None]:
    """Due times pacing ``concurrency`` streams of ``stream_s`` each (see the module docstring):
    every request is due ``stream_s / (concurrency * PACE_MARGIN)`` after the previous one."""
    if stream_s <= 0 or concurrency <= 1:
        return [None] * num_requests
    gap = stream_s / (concurrency * PACE_MARGIN)
    return [k * gap for k in range(num_requests)]


def size_of_measured_phase(
    warmup_count: int, warmup_wall_s: float, concurrency: int, spec: LoadSpec
) -> int:
    """Requests for about ``spec.duration_s`` at the warm-up's rate, at least two full rounds
    of the concurrency (so a closed loop reaches its steady state)."""
    rate = warmup_count / warmup_wall_s if warmup_wall_s > 0 else 0.0
    wanted = round(rate * spec.duration_s)
    floor = max(spec.min_requests, 2 * concurrency)
    return max(floor, min(wanted, spec.max_requests))


def _core_times() -> list[tuple[float, float]]:
    readings = []
    for times in psutil.cpu_times(percpu=True):
        idle = times.idle + getattr(times, "iowait", 0.0)
        total = sum(times)
        readings.append((total - idle, total))
    return readings


def _spent(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> tuple[float, float] | None:
    if before is None or after is None:
        return None
    return after[0] - before[0], after[1] - before[1]


def own_cpu_s() -> float:
    """This process's user and system CPU seconds so far (a load generator's own cost)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def run_level(
    name: str,
    target: Target,
    tenant: TenantSpec,
    concurrency: int,
    spec: LoadSpec,
    server_cpu: CpuReader | None,
    engine_cpu: CpuReader | None,
    idle_cpu_ms_per_s: float | None = None,
    server_rss: RssReader | None = None,
    rss_idle_bytes: int | None = None,
) -> LevelResult:
    """Warm up, then measure ``concurrency`` streams against ``target`` (and, given
    ``server_rss``, the server's peak memory meanwhile)."""
    num_warmup = spec.warmup_requests or max(concurrency, 5)
    started = time.perf_counter()
    warmup = await execute(
        target, plan(num_warmup, spec, tenant, warmup=True), max_concurrency=concurrency
    )
    warmup_wall = time.perf_counter() - started
    num_measured = size_of_measured_phase(num_warmup, warmup_wall, concurrency, spec)
    lengths = sorted(r.e2e_s for r in warmup if r.ok and r.e2e_s is not None)
    stream_s = lengths[len(lengths) // 2] if spec.stagger and lengths else 0.0
    requests = plan(
        num_measured, spec, tenant, warmup=False, first_index=num_warmup,
        offsets=staggered_offsets(num_measured, concurrency, stream_s),
    )  # fmt: skip
    cores0, wall0, generator0 = _core_times(), time.perf_counter(), own_cpu_s()
    server0 = server_cpu() if server_cpu else None
    engine0 = engine_cpu() if engine_cpu else None
    peak = _PeakRss(server_rss) if server_rss else None
    try:
        records = await execute(target, requests, max_concurrency=concurrency)
    finally:
        if peak is not None:
            await peak.stop()
    server1 = server_cpu() if server_cpu else None
    engine1 = engine_cpu() if engine_cpu else None
    wall, generator = time.perf_counter() - wall0, own_cpu_s() - generator0
    server_s = _spent(server0, server1)
    cpu = CpuWindow(
        server_s=None if server_s is None else sum(server_s),
        server_system_s=None if server_s is None else server_s[1],
        engine_s=None if (engine_s := _spent(engine0, engine1)) is None else sum(engine_s),
        wall_s=wall,
        core_busy=core_busy(cores0, _core_times()),
        generator_s=generator,
    )
    return LevelResult(
        target=name,
        concurrency=concurrency,
        num_tokens=spec.num_tokens,
        summary=summarize(records, Slos()),
        num_chunks=count_chunks(records),
        cpu=cpu,
        idle_cpu_ms_per_s=idle_cpu_ms_per_s,
        num_warmup=num_warmup,
        warmup_wall_s=warmup_wall,
        rss_idle_bytes=rss_idle_bytes,
        rss_peak_bytes=peak.bytes if peak is not None else None,
    )


class _PeakRss:
    """Samples a server's resident memory in the background, keeping the highest."""

    def __init__(self, read: RssReader) -> None:
        self._read = read
        self.bytes = read()
        self._task = asyncio.ensure_future(self._sample())

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(RSS_SAMPLE_S)
            # psutil reads /proc: a few files per process, off the loop the clients run on.
            self.bytes = max(self.bytes, await asyncio.to_thread(self._read))

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.wait((self._task,))
        self.bytes = max(self.bytes, self._read())


async def idle_cpu_rate(server_cpu: CpuReader, seconds: float) -> float:
    """The server's CPU ms per second while nothing is sent to it."""
    before, started = sum(server_cpu()), time.perf_counter()
    await asyncio.sleep(seconds)
    return (sum(server_cpu()) - before) * 1000 / (time.perf_counter() - started)
