"""How much a busy core slows its neighbours on this machine: the floor under any scaling.

``python -m bench.overhead.core_contention`` runs the same single-threaded Python loop on 1
core, then on 2, 4, ... and all of them at once (one process pinned to each), and prints each
group's mean time against the loop alone. Two loops: ``cpu`` counts in a register-bound loop;
``cache`` looks 3M random keys up in a dict of 2M entries, missing the caches as a gateway's
heap does. A gateway process that is N % slower per request when every core is busy is, by this
much, the machine's doing and not the gateway's (``docs/ARCHITECTURE.md``'s scaling figures
read it so).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import time
from multiprocessing.synchronize import Barrier

_CPU_STEPS = 20_000_000
_DICT_ENTRIES = 2_000_000
_LOOKUPS = 3_000_000


def _loop(kind: str, core: int, start: Barrier, results: multiprocessing.Queue[float]) -> None:
    os.sched_setaffinity(0, {core})
    if kind == "cpu":
        start.wait()
        began = time.perf_counter()
        n = 0
        while n < _CPU_STEPS:
            n += 1
    else:
        table = {i: i for i in range(_DICT_ENTRIES)}
        keys = [random.randrange(_DICT_ENTRIES) for _ in range(_LOOKUPS)]
        start.wait()
        began = time.perf_counter()
        total = 0
        for key in keys:
            total += table[key]
    results.put(time.perf_counter() - began)


def run_group(kind: str, cores: list[int]) -> list[float]:
    """Seconds the loop took on each of ``cores``, all started together."""
    context = multiprocessing.get_context("fork")
    start = context.Barrier(len(cores))
    results: multiprocessing.Queue[float] = context.Queue()
    workers = [context.Process(target=_loop, args=(kind, c, start, results)) for c in cores]
    for worker in workers:
        worker.start()
    times = [results.get() for _ in workers]
    for worker in workers:
        worker.join()
    return times


def group_sizes(num_cores: int) -> list[int]:
    """1, 2, 4, ... below ``num_cores``, then ``num_cores``."""
    sizes = [1]
    while sizes[-1] * 2 < num_cores:
        sizes.append(sizes[-1] * 2)
    return [*sizes, num_cores] if num_cores > 1 else sizes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.core_contention")
    parser.add_argument("--cores", help="comma-separated cores (default: every one available)")
    args = parser.parse_args(argv)
    cores = (
        [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))
    )
    print(f"{'loop':>5} {'cores':>5} {'mean s':>7} {'slowest s':>9} {'vs alone':>8}")
    for kind in ("cpu", "cache"):
        alone: float | None = None
        for size in group_sizes(len(cores)):
            times = run_group(kind, cores[:size])
            mean = statistics.fmean(times)
            alone = alone or mean
            print(f"{kind:>5} {size:>5} {mean:>7.3f} {max(times):>9.3f} {mean / alone:>7.2f}x")


if __name__ == "__main__":
    main()
