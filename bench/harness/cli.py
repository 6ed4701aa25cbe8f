"""``tandem bench``: run, sweep and compare TTFT/ITL benchmarks against any OpenAI endpoint.

    tandem bench run --base-url http://127.0.0.1:8000 --rate 4 --num-requests 200 \
        --input-len lognormal:256:0.6 --output-len fixed:64 --slo ttft:500 --slo itl:100 \
        --out-json run.json --out-csv run.csv --plots plots/
    tandem bench sweep --base-url ... --rates 1,2,4,8 --slo ttft:500 --out-json sweep.json
    tandem bench compare before.json after.json
    tandem bench dataset --out prompts.jsonl     # the same prompts for `vllm bench serve`
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.harness.arrivals import Arrival, LoadShape
from bench.harness.client import served_model
from bench.harness.compare import compare_files
from bench.harness.dataset import (
    DatasetError,
    LengthDistribution,
    load_tokenizer,
    write_vllm_custom_jsonl,
)
from bench.harness.records import RequestRecord
from bench.harness.report import print_result
from bench.harness.result import RunResult
from bench.harness.run import DatasetKind, DatasetSpec, RunConfig, build_plan, run_benchmark
from bench.harness.summary import Slos
from bench.harness.sweep import sweep
from bench.harness.workload import Api, Target, TenantSpec

console = Console(stderr=True)


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="TTFT/ITL benchmarks (run, sweep, compare)")
    sub = bench.add_subparsers(dest="bench_command")
    run = sub.add_parser("run", help="one run at one load shape")
    _add_run_arguments(run)
    sweep_parser = sub.add_parser("sweep", help="find the highest rate meeting the SLOs")
    _add_run_arguments(sweep_parser)
    sweep_parser.add_argument(
        "--rates", required=True, help="comma-separated request rates to try, e.g. 1,2,4,8"
    )
    sweep_parser.add_argument(
        "--refine", type=int, default=2, help="bisection steps past the first failing rate"
    )
    compare = sub.add_parser("compare", help="differences between two result JSON files")
    compare.add_argument("a", type=Path)
    compare.add_argument("b", type=Path)
    compare.add_argument("--plots", type=Path, help="also write comparison CDFs here")
    dataset = sub.add_parser("dataset", help="write the run's prompts for vllm bench serve")
    _add_dataset_arguments(dataset)
    dataset.add_argument("--num-requests", type=int, default=100)
    dataset.add_argument("--seed", type=int, default=0)
    dataset.add_argument("--out", type=Path, required=True, help="JSONL file to write")


def _add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dataset", choices=[k.value for k in DatasetKind], default=DatasetKind.SYNTHETIC.value
    )
    parser.add_argument(
        "--input-len",
        default="fixed:256",
        help="prompt tokens: fixed:N, uniform:LO:HI, normal:MEAN:STD, lognormal:MEDIAN:SIGMA",
    )
    parser.add_argument("--output-len", default="fixed:64", help="max_tokens, same forms")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0)
    parser.add_argument("--prefix-groups", type=int, default=1)
    parser.add_argument("--tokenizer", help="tokenizer.json or a model folder (default: bundled)")
    parser.add_argument("--tenants", type=Path, help="JSON list of tenants (name, share, ...)")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--api", choices=[a.value for a in Api], default=Api.CHAT.value)
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY"
    )
    _add_dataset_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=0, help="requests sent first, not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, help="closed loop: this many in flight")
    parser.add_argument("--rate", type=float, help="open loop: requests per second")
    parser.add_argument(
        "--arrival",
        choices=[a.value for a in Arrival if a is not Arrival.CONCURRENCY],
        default=Arrival.POISSON.value,
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape")
    parser.add_argument("--burst-size", type=int, default=8)
    parser.add_argument("--burst-interval", type=float, default=1.0, help="seconds")
    parser.add_argument("--max-concurrency", type=int, help="cap in flight for open loops")
    parser.add_argument("--ignore-eos", action="store_true", help="exactly max_tokens each")
    parser.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged in")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="NAME:MS",
        help="ttft, tpot, itl (longest chunk gap) or e2e, in ms; repeatable",
    )
    parser.add_argument("--slo-attainment", type=float, default=0.9)
    parser.add_argument(
        "--no-token-check",
        action="store_true",
        help="do not compare usage with the re-tokenised streamed text",
    )
    parser.add_argument("--label", help="name of the run in reports (default: the command)")
    parser.add_argument("--out-json", type=Path, help="full result with per-request records")
    parser.add_argument("--out-csv", type=Path, help="per-request records")
    parser.add_argument("--plots", type=Path, help="folder for PNG plots")
    parser.add_argument("--no-progress", action="store_true")


def run_bench(args: argparse.Namespace) -> int:
    """Entry point of ``tandem bench``; returns the exit status."""
    try:
        if args.bench_command == "compare":
            return compare_files(args.a, args.b, Console(), args.plots)
        if args.bench_command == "dataset":
            return _write_dataset(args)
        if args.bench_command in ("run", "sweep"):
            return _run_event_loop(_run(args))
    except (ValueError, DatasetError) as exc:
        console.print(f"[red]tandem bench:[/] {exc}")
        return 2
    console.print("usage: tandem bench {run,sweep,compare,dataset} --help")
    return 2


def _run_event_loop(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:  # the load generator is cheaper on uvloop, but works without
        return int(asyncio.run(coro))
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return int(runner.run(coro))


def _tenants(args: argparse.Namespace) -> tuple[TenantSpec, ...]:
    if args.tenants is None:
        return (TenantSpec("default", api_key=getattr(args, "api_key", None)),)
    try:
        raw = json.loads(args.tenants.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--tenants {args.tenants}: {exc}") from exc
    items = raw.get("tenants") if isinstance(raw, dict) else raw
    if not isinstance(items, list) or not items:
        raise ValueError(f"--tenants {args.tenants}: expected a non-empty JSON list of tenants")
    tenants = [TenantSpec.from_dict(item) for item in items]
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"--tenants {args.tenants}: tenant names must be unique: {names}")
    default_key = getattr(args, "api_key", None)
    return tuple(
        t if t.api_key or not default_key else dataclasses.replace(t, api_key=default_key)
        for t in tenants
    )


def _dataset(args: argparse.Namespace) -> DatasetSpec:
    if args.shared_prefix_tokens < 0 or args.prefix_groups < 1:
        raise ValueError("--shared-prefix-tokens must be >= 0 and --prefix-groups >= 1")
    return DatasetSpec(
        kind=DatasetKind(args.dataset),
        input_len=LengthDistribution.parse(args.input_len),
        output_len=LengthDistribution.parse(args.output_len),
        shared_prefix_tokens=args.shared_prefix_tokens,
        prefix_groups=args.prefix_groups,
    )


def _shape(args: argparse.Namespace) -> LoadShape:
    if args.concurrency is not None:
        if args.rate is not None:
            raise ValueError("give --concurrency (closed loop) or --rate, not both")
        return LoadShape(Arrival.CONCURRENCY, max_concurrency=args.concurrency)
    arrival = Arrival(args.arrival)
    if arrival is not Arrival.BURST and args.rate is None and args.bench_command == "run":
        raise ValueError("give a load: --concurrency N, --rate R or --arrival burst")
    return LoadShape(
        arrival,
        rate=args.rate if args.rate is not None else float("inf"),
        max_concurrency=args.max_concurrency,
        burstiness=args.burstiness,
        burst_size=args.burst_size,
        burst_interval_s=args.burst_interval,
    )


async def _run(args: argparse.Namespace) -> int:
    tenants = _tenants(args)
    key = next((t.api_key for t in tenants if t.api_key), None)
    model = args.model or await served_model(args.base_url, key)
    config = RunConfig(
        target=Target(
            base_url=args.base_url,
            model=model,
            api=Api(args.api),
            timeout_s=args.timeout,
            ignore_eos=args.ignore_eos,
            extra_body=args.extra_body,
        ),
        shape=_shape(args),
        num_requests=args.num_requests,
        warmup_requests=args.warmup,
        seed=args.seed,
        dataset=_dataset(args),
        tenants=tenants,
        slos=Slos.parse(args.slo),
        slo_attainment=args.slo_attainment,
        check_token_counts=not args.no_token_check,
        label=args.label or args.bench_command,
    )
    if config.num_requests < 1 or config.warmup_requests < 0:
        raise ValueError("--num-requests must be >= 1 and --warmup >= 0")
    tokenizer = await asyncio.to_thread(load_tokenizer, args.tokenizer)
    with _progress(args.no_progress) as progress:

        async def run_at(point: RunConfig) -> RunResult:
            task = progress.add_task(
                point.label, total=point.warmup_requests + point.num_requests, failed=0
            )
            failures = 0

            def on_done(record: RequestRecord) -> None:
                nonlocal failures
                failures += 0 if record.ok else 1
                progress.update(task, advance=1, failed=failures)

            return await run_benchmark(point, tokenizer, on_done)

        if args.bench_command == "sweep":
            rates = [float(r) for r in args.rates.split(",") if r.strip()]
            result = await sweep(config, rates, run_at, refine=args.refine)
        else:
            result = await run_at(config)
    print_result(result, Console())
    _write_outputs(result, args)
    return 0 if result.summary.completed else 1


def _progress(disabled: bool) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=console,
        disable=disabled,
        transient=False,
    )


def _write_outputs(result: RunResult, args: argparse.Namespace) -> None:
    if args.out_json:
        result.save_json(args.out_json)
        console.print(f"result: {args.out_json}")
    if args.out_csv:
        result.save_csv(args.out_csv)
        console.print(f"records: {args.out_csv}")
    if args.plots:
        from bench.harness.plots import plot_result  # matplotlib is slow to import

        args.plots.mkdir(parents=True, exist_ok=True)
        for path in plot_result(result, args.plots):
            console.print(f"plot: {path}")


def _write_dataset(args: argparse.Namespace) -> int:
    tokenizer = load_tokenizer(args.tokenizer)
    config = RunConfig(
        target=Target(base_url="http://unused", model="unused"),
        shape=LoadShape(Arrival.CONCURRENCY, max_concurrency=1),
        num_requests=args.num_requests,
        seed=args.seed,
        dataset=_dataset(args),
        tenants=_tenants(args),
    )
    prompts = [p.prompt for p in build_plan(config, tokenizer).measured]
    write_vllm_custom_jsonl(prompts, args.out)
    console.print(
        f"{len(prompts)} prompts, {sum(p.tokens for p in prompts)} prompt tokens: {args.out} "
        "(vllm bench serve --dataset-name custom --dataset-path FILE --disable-shuffle "
        "--custom-output-len -1 --skip-chat-template)"
    )
    return 0
