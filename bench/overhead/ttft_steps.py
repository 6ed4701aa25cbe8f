"""Where a streamed request's time goes before its first event, at one stream.

``python -m bench.overhead.ttft_steps [--duration-s 8]`` starts the fake engine and ``tandem
up`` (colocated, auth and quotas on) with a timestamp at each step (``ttft_marks.py``), sends
one streamed request at a time for ``--duration-s``, and prints each step's median time after
the route's entry and the median step from the one before. The gateway's own time before the
route (uvicorn's parsing, the middleware) is not in it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.overhead.fake_vllm import Timing
from bench.overhead.procs import start_fake_engine
from bench.overhead.servers import TandemSetup, start_tandem
from bench.overhead.ttft_marks import MARKS_ENV, STEPS

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.ttft_steps")
    parser.add_argument("--duration-s", type=float, default=8.0)
    parser.add_argument("--skip", type=int, default=10, help="first requests left out (warm-up)")
    args = parser.parse_args(argv)
    work_dir = Path(tempfile.mkdtemp(prefix="tandem-ttft-steps-"))
    marks = work_dir / "marks.json"
    engine = start_fake_engine("fake", Timing(num_tokens=8, itl_s=0.02), MODEL, work_dir, None)
    try:
        gateway, key = start_tandem(
            TandemSetup(two_legs=False), engine.url, engine.url, MODEL, work_dir, None,
            entry="bench.overhead.ttft_marks", extra_env={MARKS_ENV: str(marks)},
        )  # fmt: skip
        try:
            assert key is not None  # the setup has auth on
            load = [
                sys.executable, "-m", "bench.overhead.scaling_load", "--url", gateway.url,
                "--api-key", key, "--model", MODEL, "--concurrency", "1",
                "--start-at", str(time.time()), "--warmup-s", "0",
                "--duration-s", str(args.duration_s), "--tokens", "8", "--stagger-s", "0",
            ]  # fmt: skip
            subprocess.run(load, check=True, capture_output=True)
        finally:
            gateway.stop()
        records = json.loads(marks.read_text())[args.skip :]
    finally:
        engine.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    print(f"{len(records)} requests, one at a time; ms after the route's entry (medians)")
    print(f"{'step':20} {'at':>8} {'step':>8}")
    for step, at, gap, _ in step_table(records):
        print(f"{step:20} {at:8.3f} {gap:8.3f}")


if __name__ == "__main__":
    main()
