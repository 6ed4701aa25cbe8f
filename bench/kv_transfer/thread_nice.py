"""What NIXL's threads' nice value does to a decode worker's KV reads, in pairs on one worker.

    python -m bench.kv_transfer nice [--sizes 1024 4096] [--pairs 8]

Against live workers (``tandem up``, run as root on their host): the decode worker's NIXL
threads are the ones Tandem's plugin lowered (``kv_transfer/nixl_progress.py``, nice value
``TANDEM_NIXL_THREAD_NICE``). Each pair of split requests runs one with those threads back at
nice 0 and one at their nice value, alternating which goes first, and takes each transfer's
time from the decode worker's NIXL counters. Pairs, not runs apart: on a shared VM the same read
took 4x longer in one quarter of an hour than in the next, so only requests that alternate
compare. The threads get their nice value back however the run ends. Lowering a nice value
needs root (``CAP_SYS_NICE``).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import psutil

from bench.kv_transfer.common import Target, chat, count_tokens, prompt_of, split_request
from bench.kv_transfer.transfer import memcpy_seconds, nixl_totals, worker_tree
from kv_transfer.nixl_progress import thread_ids

SIZES = (1024, 4096)
SETTLE_S = 1.5
"""vLLM publishes connector stats on its logging interval, not when a transfer ends."""


def decode_worker(url: str) -> psutil.Process:
    """The ``VLLM::Worker`` (the model's process) of the vLLM server at ``url``."""
    workers = [p for p in worker_tree(url) if p.name() == "VLLM::Worker"]
    if len(workers) != 1:
        raise RuntimeError(f"expected one VLLM::Worker under {url}, found {len(workers)}")
    return workers[0]


def lowered_threads(pid: int) -> tuple[list[int], int]:
    """The threads of ``pid`` above its main thread's nice value, and that value of theirs."""
    own = os.getpriority(os.PRIO_PROCESS, pid)
    lowered = {}
    for tid in thread_ids(pid):
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
        except ProcessLookupError:
            continue  # the thread ended
        if nice > own:
            lowered[tid] = nice
    if not lowered:
        raise RuntimeError(
            f"no thread of worker {pid} runs below its main thread's priority: is "
            "TANDEM_NIXL_THREAD_NICE 0, or the worker not started by Tandem?"
        )
    values = set(lowered.values())
    if len(values) != 1:
        raise RuntimeError(f"worker {pid}'s lowered threads differ in nice value: {values}")
    return sorted(lowered), values.pop()


def set_nice(tids: list[int], nice: int) -> None:
    for tid in tids:
        os.setpriority(os.PRIO_PROCESS, tid, nice)


def pair_orders(pairs: int, lowered: int) -> Iterator[tuple[int, int]]:
    """The nice values of each pair, in the order they run: 0 first, then the other first."""
    for index in range(pairs):
        yield (0, lowered) if index % 2 == 0 else (lowered, 0)


@dataclass(frozen=True, slots=True)
class PairedRow:
    tokens: int
    lowered: int
    xfer_s: dict[int, list[float]]
    handoff_s: dict[int, list[float]]
    memcpy_s: float
    """A memcpy of the transfer's bytes on this machine, in the same run (numpy, best of 5)."""

    def render(self) -> str:
        def median_ms(values: dict[int, list[float]], nice: int) -> float:
            return statistics.median(values[nice]) * 1e3

        at_0, at_low = median_ms(self.xfer_s, 0), median_ms(self.xfer_s, self.lowered)
        return (
            f"{self.tokens:>7} {len(self.xfer_s[0]):>5} {at_0:>9.1f} {at_low:>9.1f} "
            f"{at_low / at_0:>6.2f} {self.memcpy_s * 1e3:>9.2f} "
            f"{at_low / (self.memcpy_s * 1e3):>9.1f} {median_ms(self.handoff_s, 0):>10.0f} "
            f"{median_ms(self.handoff_s, self.lowered):>10.0f}"
        )


def header(lowered: int) -> str:
    return (
        f"{'tokens':>7} {'pairs':>5} {'xfer @0':>9} {f'xfer @{lowered}':>9} {'ratio':>6} "
        f"{'memcpy':>9} {f'@{lowered}/cpy':>9} {'leg 2 @0':>10} {f'leg 2 @{lowered}':>10}"
    )


@dataclass(frozen=True, slots=True)
class Read:
    xfer_s: float
    handoff_s: float
    kv_bytes: float
    tokens: int


async def one_read(target: Target, tokens: int) -> Read:
    """One split request of about ``tokens``, its transfer read from NIXL's counters."""
    text = await prompt_of(target, tokens)
    counted = await count_tokens(target.session, target.decode, target.model, text)
    bytes_before, before = await nixl_totals(target)
    split = await split_request(target, chat(target.model, text, 2, True))
    await asyncio.sleep(SETTLE_S)
    bytes_after, after = await nixl_totals(target)
    return Read(after - before, split.handoff_s, bytes_after - bytes_before, counted)


async def measure(
    target: Target, tids: list[int], lowered: int, size: int, pairs: int
) -> PairedRow:
    reads: dict[int, list[Read]] = {0: [], lowered: []}
    for order in pair_orders(pairs, lowered):
        for nice in order:
            set_nice(tids, nice)
            reads[nice].append(await one_read(target, size))
    every = reads[0] + reads[lowered]
    return PairedRow(
        tokens=int(statistics.median(read.tokens for read in every)),
        lowered=lowered,
        xfer_s={nice: [read.xfer_s for read in side] for nice, side in reads.items()},
        handoff_s={nice: [read.handoff_s for read in side] for nice, side in reads.items()},
        memcpy_s=memcpy_seconds(int(statistics.median(read.kv_bytes for read in every))),
    )


async def run(target: Target, sizes: list[int], pairs: int) -> None:
    worker = decode_worker(target.decode)
    tids, lowered = lowered_threads(worker.pid)
    print(
        f"Decode worker {worker.pid}: {len(tids)} threads at nice {lowered}, switched to 0 and "
        f"back for alternate requests (transfer: NIXL's counters; memcpy: the same bytes, numpy; "
        f"leg 2: the hand-off; medians, ms):"
    )
    print(header(lowered))
    try:
        for size in sizes:
            print((await measure(target, tids, lowered, size, pairs)).render(), flush=True)
    finally:
        set_nice(tids, lowered)
