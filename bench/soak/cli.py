"""``python -m bench.soak``: the real stack under a mixed load while faults are injected,
then its invariants checked.

    python -m bench.soak --minutes 20                 # the full soak
    python -m bench.soak --minutes 3 --json soak.json # what CI runs (tests/chaos)

The stack is ``tandem up`` with two gateway processes over a Redis and a PostgreSQL the soak
owns, one prefill and one decode vLLM CPU worker (bench/soak/stack.py); the load is three
tenants of closed-loop streaming clients (bench/soak/load.py); the faults are injected one at
a time, in turn, until the minutes are over and every kind ran (bench/soak/faults.py); the
invariants are in bench/soak/check.py. Prints the figures; exits 1 when an invariant failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console

from bench.soak import report
from bench.soak.faults import FaultKind
from bench.soak.run import SoakSpec, run_soak


def _kinds(text: str) -> tuple[FaultKind, ...]:
    try:
        return tuple(FaultKind(name.strip()) for name in text.split(",") if name.strip())
    except ValueError as exc:
        known = ", ".join(FaultKind)
        raise argparse.ArgumentTypeError(f"{exc}; the kinds are {known}") from exc


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=20.0,
        help="how long the load runs (at least one cycle of faults runs)",
    )
    parser.add_argument(
        "--faults",
        type=_kinds,
        default=tuple(FaultKind),
        help=f"comma-separated fault kinds, in order (default: all: {','.join(FaultKind)})",
    )
    parser.add_argument(
        "--gap-s",
        type=float,
        default=10.0,
        help="quiet seconds before each fault, after the previous recovered",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the stack's logs and state go (default: a new temp dir)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.minutes <= 0:
        parser.error("--minutes must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    # Piped (a CI log, tee), rich would wrap at 80 columns and cut the fault names.
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(f"soak: {args.minutes:g} min, faults {','.join(args.faults)}; logs in {workdir}")
    spec = SoakSpec(workdir=workdir, minutes=args.minutes, kinds=args.faults, gap_s=args.gap_s)
    result = asyncio.run(run_soak(spec))
    for table in (
        report.requests_table(result),
        report.faults_table(result),
        report.checks_table(result),
    ):
        console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(result), indent=2) + "\n")
    console.print("every invariant held" if result.ok else "AN INVARIANT FAILED")
    return 0 if result.ok else 1
