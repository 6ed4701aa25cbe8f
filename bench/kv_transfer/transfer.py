"""Transfer cost by prompt size, prefill interference, and what idle workers cost.

1. For prompts of about 256, 1k, 2k and 4k tokens: KV bytes and transfer time (the decode
   worker's ``vllm:nixl_bytes_transferred`` / ``vllm:nixl_xfer_time_seconds`` deltas),
   throughput, this machine's memcpy time for the same bytes (numpy, same run) and the ratio;
   TTFT split (leg 1, then leg 2 to its first token: the hand-off) vs colocated (one worker
   does both). Medians over ``--repeats`` fresh prompts per size.
2. Interference: ITL of running decode streams while a burst of long prompts arrives, with the
   burst prefilled on the prefill worker (disaggregated) or on the decode worker (colocated).
3. Idle cost: the CPU each worker's process tree uses while nothing is asked of it (NIXL's
   progress thread; ``TANDEM_NIXL_PROGRESS_DELAY_US``).

Every prompt starts with a fresh id, so no prefix cache hides work.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil

from bench.kv_transfer.common import (
    Target,
    chat,
    count_tokens,
    metric_sum,
    prompt_of,
    split_request,
    stream_times,
)
from bench.stats import percentile

SIZES = (256, 1024, 2048, 4096)


@dataclass(frozen=True, slots=True)
class SizeRow:
    tokens: int
    kv_bytes: float
    xfer_s: float
    memcpy_s: float
    prefill_leg_s: float
    handoff_s: float
    ttft_split_s: float
    ttft_coloc_s: float

    def render(self) -> str:
        gbps = self.kv_bytes / self.xfer_s / 1e9 if self.xfer_s > 0 else float("nan")
        ratio = (
            self.xfer_s / self.memcpy_s if self.memcpy_s > 0 and self.xfer_s > 0 else float("nan")
        )
        return (
            f"{self.tokens:>7} {self.kv_bytes / 1e6:>8.1f} {self.xfer_s * 1e3:>8.1f} {gbps:>6.2f} "
            f"{self.memcpy_s * 1e3:>9.2f} {ratio:>11.1f} {self.ttft_split_s * 1e3:>9.0f} "
            f"{self.prefill_leg_s * 1e3:>8.0f} {self.handoff_s * 1e3:>8.0f} "
            f"{self.ttft_coloc_s * 1e3:>9.0f}"
        )


HEADER = (
    f"{'tokens':>7} {'KV MB':>8} {'xfer ms':>8} {'GB/s':>6} {'memcpy ms':>9} {'xfer/memcpy':>11} "
    f"{'TTFT split':>9} {'= leg 1':>8} {'+ leg 2':>8} {'TTFT coloc':>9}"
)


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    source = np.ones(max(1, num_bytes), dtype=np.uint8)
    return best_copy_seconds(source, np.empty_like(source), repeats)


def best_copy_seconds(source: np.ndarray, target: np.ndarray, repeats: int) -> float:
    """The fastest of ``repeats`` memcpys of ``source`` into ``target`` (numpy, one thread)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return best


async def nixl_totals(target: Target) -> tuple[float, float]:
    """The decode worker's NIXL bytes and seconds so far."""
    kv_bytes = await metric_sum(target.session, target.decode, "vllm:nixl_bytes_transferred_sum")
    seconds = await metric_sum(target.session, target.decode, "vllm:nixl_xfer_time_seconds_sum")
    return kv_bytes, seconds


async def measure_size(target: Target, size: int, repeats: int) -> SizeRow:
    rows: list[SizeRow] = []
    for _ in range(repeats):
        text = await prompt_of(target, size)
        tokens = await count_tokens(target.session, target.decode, target.model, text)
        bytes_before, seconds_before = await nixl_totals(target)
        split = await split_request(target, chat(target.model, text, 4, True))
        # vLLM publishes connector stats on its logging interval, not when a transfer ends.
        await asyncio.sleep(1.5)
        bytes_after, seconds_after = await nixl_totals(target)
        kv_bytes, xfer_s = bytes_after - bytes_before, seconds_after - seconds_before
        other = await prompt_of(target, size)
        ttft_coloc, _ = await stream_times(
            target, target.decode, chat(target.model, other, 4, True), time.perf_counter()
        )
        # A vLLM worker busy-waits for a second after its last step (its shared-memory queue
        # spins before it sleeps); on a small machine that would slow the next leg 1.
        await asyncio.sleep(1.5)
        row = SizeRow(
            tokens, kv_bytes, xfer_s, memcpy_seconds(int(kv_bytes)), split.prefill_leg_s,
            split.handoff_s, split.ttft_s, ttft_coloc,
        )  # fmt: skip
        rows.append(row)
    medians = (statistics.median(getattr(row, name) for row in rows) for name in SizeRow.__slots__)
    return SizeRow(*medians)


async def interference(target: Target, split: bool, burst: int, burst_tokens: int) -> list[float]:
    """ITL of 4 running streams while ``burst`` long prompts arrive; returns the gaps (s)."""

    def story() -> dict[str, Any]:
        return chat(target.model, f"{uuid.uuid4().hex} Tell a long story.", 160, True)

    running = [
        asyncio.create_task(stream_times(target, target.decode, story(), time.perf_counter()))
        for _ in range(4)
    ]
    await asyncio.sleep(1.0)  # let them reach steady decoding
    prompts = [await prompt_of(target, burst_tokens) for _ in range(burst)]
    burst_start = time.perf_counter()
    if split:
        await asyncio.gather(
            *(split_request(target, chat(target.model, p, 1, True)) for p in prompts)
        )
    else:
        await asyncio.gather(
            *(
                stream_times(
                    target, target.decode, chat(target.model, p, 1, True), time.perf_counter()
                )
                for p in prompts
            )
        )
    burst_end = time.perf_counter()
    gaps: list[float] = []
    for _, arrivals in await asyncio.gather(*running):
        gaps += [
            later - earlier
            for earlier, later in itertools.pairwise(arrivals)
            if burst_start <= later <= burst_end + 0.5
        ]
    return gaps


def worker_tree(url: str) -> list[psutil.Process]:
    """The processes of the vLLM server listening at ``url`` (API server, engine, workers)."""
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for connection in psutil.net_connections(kind="tcp"):
        address = connection.laddr
        listening = connection.status == psutil.CONN_LISTEN and isinstance(address, tuple)
        if listening and address and address[1] == port and connection.pid:
            server = psutil.Process(connection.pid)
            return [server, *server.children(recursive=True)]
    raise RuntimeError(f"no process listens on port {port} (run this on the workers' host)")


def idle_cores(processes: list[psutil.Process], seconds: float) -> float:
    """Cores the processes used together over ``seconds`` of wall time; one that exits during
    the window is left out of it."""

    def cpu_s(process: psutil.Process) -> float | None:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            return None
        return times.user + times.system

    before, start = {p.pid: cpu_s(p) for p in processes}, time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    used = 0.0
    for process in processes:
        first, last = before[process.pid], cpu_s(process)
        if first is not None and last is not None:
            used += last - first
    return used / elapsed


async def run(target: Target, args: argparse.Namespace) -> None:
    await asyncio.sleep(2)  # let the warm-up settle before the idle reading
    print(f"Idle CPU over {args.idle_seconds:.0f} s (each worker's whole process tree):")
    for role, url in (("prefill", target.prefill), ("decode", target.decode)):
        cores = await asyncio.to_thread(idle_cores, worker_tree(url), args.idle_seconds)
        print(f"  {role:<8} {url:<26} {cores:.3f} cores")
    print(f"\nKV transfer by prompt size (decode worker's NIXL counters; memcpy: numpy; "
          f"ms; median of {args.repeats}):")  # fmt: skip
    print(HEADER)
    for size in SIZES:
        print((await measure_size(target, size, args.repeats)).render(), flush=True)
    print(f"\nITL of 4 running streams during a burst of {args.burst} x ~{args.burst_tokens}"
          "-token prompts:")  # fmt: skip
    columns = ("gaps", "p50 ms", "p90 ms", "p99 ms", "max ms")
    print(f"{'burst prefilled on':<22} " + " ".join(f"{c:>7}" for c in columns))
    for label, split in (("prefill worker (split)", True), ("decode worker (coloc)", False)):
        gaps = [g * 1e3 for g in await interference(target, split, args.burst, args.burst_tokens)]
        figures = [percentile(gaps, q) for q in (50, 90, 99)] + [max(gaps, default=float("nan"))]
        print(f"{label:<22} {len(gaps):>7} " + " ".join(f"{f:>7.1f}" for f in figures), flush=True)
