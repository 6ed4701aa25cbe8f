"""``python -m bench.ledger``: what the usage ledger costs.

    python -m bench.ledger writes                  # SQLite and PostgreSQL, ~1.5 min
    python -m bench.ledger writes --backend postgres --postgres-url postgresql://u@host/scratch
    python -m bench.ledger latency --json ledger-latency.json     # billing on vs off, ~2 min

``writes``: records per second through the real ``LedgerWriter`` (fed from an event loop by a
saturating producer and by producers paced at ``--rates``, flushed every 0.2 s as in the
gateway, counted once ``flush()`` returned and the ledger's row count matches),
``store.insert_usage`` alone at batches of 1, 100 and 1000, and what one ``submit()`` costs the
event loop (see ``writes``). Without ``--postgres-url``, PostgreSQL is a throwaway cluster from
``tests.postgres_server`` (fsync off: an upper bound; the settings are printed). ``latency``:
TTFT, end-to-end latency, throughput and the gateway's CPU per request with billing on and
off, A/B/B/A over ``bench.overhead``'s fast fake engines (see ``latency``).
Figures only: nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.ledger import report
from bench.ledger.latency import LatencySpec, run_latency
from bench.ledger.writes import BACKENDS, BackendResult, BenchError, WritesSpec, run_backend
from bench.overhead.report import print_all, write_json

_WRITES, _LATENCY = WritesSpec(), LatencySpec()


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {text!r}")
    return value


def _rates(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive_int(part) for part in text.split(",") if part.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected rates like 1000,5000, not {text!r}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.ledger",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", type=Path, metavar="PATH", help="write every figure here")

    writes = commands.add_parser("writes", parents=[common], help="ledger write throughput")
    writes.add_argument("--backend", choices=(*BACKENDS, "both"), default="both")
    writes.add_argument(
        "--records", type=_positive_int, default=_WRITES.num_records,
        help="records per insert batch size and for the submit() loop (default %(default)s)",
    )  # fmt: skip
    writes.add_argument(
        "--seconds", type=_positive_float, default=_WRITES.seconds,
        help="length of each sustained run, and cap per batch size (default %(default)s)",
    )  # fmt: skip
    writes.add_argument(
        "--rates", type=_rates, default=_WRITES.rates, metavar="R,R,...",
        help="records/s of the paced producers (default %(default)s)",
    )  # fmt: skip
    writes.add_argument(
        "--postgres-url",
        help="a scratch PostgreSQL database (its ledger tables are created and filled); "
        "default: a throwaway cluster (tests.postgres_server, fsync off)",
    )

    latency = commands.add_parser("latency", parents=[common], help="billing on vs off")
    latency.add_argument(
        "--requests", type=_positive_int, default=_LATENCY.num_requests,
        help="measured requests per arm, half in each of its two runs (default %(default)s)",
    )  # fmt: skip
    latency.add_argument("--concurrency", type=_positive_int, default=_LATENCY.concurrency)
    latency.add_argument(
        "--tokens", type=_positive_int, default=_LATENCY.num_tokens, help="tokens per stream"
    )
    latency.add_argument(
        "--itl-ms", type=_positive_float, default=_LATENCY.itl_s * 1000,
        help="fake engine: gap between tokens",
    )  # fmt: skip
    latency.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console(width=220)
    import uvloop  # the gateway's loop, so submit() and the writer run as they do there

    started = time.time()
    try:
        if args.command == "writes":
            payload = uvloop.run(_writes(args, console))
        else:
            payload = uvloop.run(_latency(args, console))
    except BenchError as exc:
        console.print(f"[red]{exc}[/]")
        return 2
    if args.json:
        payload["elapsed_s"] = time.time() - started
        write_json(args.json, payload)
        console.print(f"figures written to {args.json}")
    return 0


async def _writes(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    spec = WritesSpec(num_records=args.records, seconds=args.seconds, rates=args.rates)
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    results: list[BackendResult] = []
    for backend in backends:
        console.print(f"[bold]{backend}[/] ...")
        results.append(await run_backend(backend, spec, args.postgres_url))
    for line in report.durability_lines(results):
        console.print(line)
    print_all(
        console,
        [
            report.sustained_table(results, spec.flush_interval_s),
            report.submit_table(results),
            report.batch_table(results),
        ],
    )
    return {
        "benchmark": "ledger writes",
        "config": {
            "num_records": spec.num_records,
            "seconds": spec.seconds,
            "batch_sizes": list(spec.batch_sizes),
            "rates": list(spec.rates),
            "flush_interval_s": spec.flush_interval_s,
            "postgres": "url given" if args.postgres_url else "tests.postgres_server cluster",
        },
        "results": [result.to_dict() for result in results],
    }


async def _latency(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    spec = LatencySpec(
        num_requests=args.requests,
        concurrency=args.concurrency,
        num_tokens=args.tokens,
        itl_s=args.itl_ms / 1000,
        pin=not args.no_pin,
    )
    console.print(
        f"{spec.num_requests} requests per arm at concurrency {spec.concurrency}, "
        f"{spec.num_tokens} tokens every {spec.itl_s * 1000:g} ms; runs: on, off, off, on"
    )
    output = await run_latency(spec, console)
    for note in output.notes:
        console.print(note)
    print_all(console, [report.runs_table(output.runs), report.arms_table(output)])
    return {
        "benchmark": "ledger latency",
        "config": {
            "num_requests_per_arm": spec.num_requests,
            "concurrency": spec.concurrency,
            "num_tokens": spec.num_tokens,
            "itl_ms": spec.itl_s * 1000,
            "prompt_words": spec.prompt_words,
            "pinned": spec.pin,
        },
        "notes": output.notes,
        "runs": [run.to_dict() for run in output.runs],
        "arms": {"on": output.arm(True), "off": output.arm(False)},
        "difference_on_minus_off": output.difference(),
    }
