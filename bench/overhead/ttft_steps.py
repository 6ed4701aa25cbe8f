"""Where a streamed request's time goes before its first event, at one stream.

``python -m bench.overhead.ttft_steps [--duration-s 8]`` starts the fake engine and ``tandem
up`` (colocated, auth and quotas on) with a timestamp at each step (``ttft_marks.py``), sends
one streamed request at a time for ``--duration-s``, and prints each step's median time after
the route's entry and the median step from the one before; and, first, the median time from
the server's having parsed the request's head to the route's entry (the ASGI task's start, the
middleware, FastAPI's routing). The parsing itself and the network are not in it.

``--busy-concurrency N`` runs it again with N streams at a time and adds each step's median
there. A step without a wait in it (authentication, the request's validation and build,
admission's own work) then shows what the same code costs on a busy core, warm in the CPU's
caches; at one stream at a time the gateway idles between requests, and each request meets
its code cold. (A step that waits on the event loop also queues there behind the other
streams' work, so it reads longer.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.overhead.fake_vllm import Timing
from bench.overhead.scaling_load import LoadArgs
from bench.overhead.servers import wrapped_tandem_over_fake
from bench.overhead.ttft_marks import HEAD, MARKS_ENV, STEPS

MODEL = "fake-model"


def step_table(records: list[dict[str, float]]) -> list[tuple[str, float, float, int]]:
    """(step, median ms after the route, median ms after the step before, requests) for each
    step some request reached, in ``STEPS`` order."""
    rows = []
    before = "route"
    for step in STEPS:
        seen = [r for r in records if step in r and "route" in r]
        if not seen:
            continue
        at = statistics.median((r[step] - r["route"]) * 1000 for r in seen)
        gaps = [(r[step] - r[before]) * 1000 for r in seen if before in r]
        rows.append((step, at, statistics.median(gaps) if gaps else float("nan"), len(seen)))
        before = step
    return rows


def head_to_route_ms(records: list[dict[str, float]]) -> float | None:
    """Median ms from the head parsed to the route's entry; None when no record has both."""
    gaps = [(r["route"] - r[HEAD]) * 1000 for r in records if HEAD in r and "route" in r]
    return statistics.median(gaps) if gaps else None


def _run(concurrency: int, duration_s: float, skip: int) -> list[dict[str, float]]:
    """The marks of each request after the first ``skip``, ``concurrency`` at a time."""
    with tempfile.TemporaryDirectory(prefix="tandem-ttft-steps-") as tmp:
        marks = Path(tmp) / "marks.json"
        timing = Timing(num_tokens=8, itl_s=0.02)
        with wrapped_tandem_over_fake(
            Path(tmp), timing, MODEL, "bench.overhead.ttft_marks", {MARKS_ENV: str(marks)}
        ) as (gateway, key):
            load = LoadArgs(
                gateway.url, key, MODEL, concurrency=concurrency, start_at=time.time(),
                warmup_s=0, duration_s=duration_s, tokens=8, stagger_s=0,
            )  # fmt: skip
            subprocess.run(load.command(), check=True, capture_output=True)
        records: list[dict[str, float]] = json.loads(marks.read_text())  # written at exit
        return records[skip:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.ttft_steps")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--skip", type=int, default=10, help="first requests left out (warm-up)")
    parser.add_argument(
        "--busy-concurrency", type=int, default=0,
        help="also run N streams at a time and show each step's median there (0: no)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    records = _run(1, args.duration_s, args.skip)
    busy: dict[str, float] = {}
    if args.busy_concurrency > 0:
        busy_records = _run(args.busy_concurrency, args.duration_s, args.skip)
        busy = {step: gap for step, _, gap, _ in step_table(busy_records)}
        print(f"{len(busy_records)} requests, {args.busy_concurrency} at a time (medians)")
    print(f"{len(records)} requests, one at a time (medians)")
    before_route = head_to_route_ms(records)
    if before_route is not None:
        print(f"head parsed -> route entered: {before_route:.3f} ms")
    print("ms after the route's entry:")
    busy_header = f" {f'step at {args.busy_concurrency}':>12}" if busy else ""
    print(f"{'step':20} {'at':>8} {'step':>8}{busy_header}")
    for step, at, gap, _ in step_table(records):
        busy_gap = f" {busy[step]:12.3f}" if step in busy else ""
        print(f"{step:20} {at:8.3f} {gap:8.3f}{busy_gap}")


if __name__ == "__main__":
    main()
