"""``tandem profile``: measure what one worker sustains, the planner's model of a replica.

Against one worker's OpenAI-compatible endpoint (a vLLM server: a decode worker of the version,
or any colocated one), with the same load generator as ``tandem bench``:

- **Prefill**, per prompt length: requests one at a time, each asking for one output token;
  the worker's prefill throughput at that length is the prompt's tokens over the median time
  to that token (prefill alone, with nothing else running on the worker).
- **Decode**, per concurrency: a closed loop of that many streams with a short prompt and
  ``--output-len`` tokens each (``ignore_eos``); the inter-token latency is the mean of every
  gap between two tokens of a stream (the planner's decode model works on means).

The result is ``planner.profile.Profile``, written as its JSON file; the planner refuses to run
without one and names this command. Nothing else may run on the worker meanwhile: the figures
are one worker's capacity, not a share of it.

    tandem profile --base-url http://127.0.0.1:8200 --tokenizer FOLDER --out profile.json
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from bench.harness.arrivals import Arrival, LoadShape
from bench.harness.client import served_model
from bench.harness.dataset import DatasetError, LengthDistribution, load_tokenizer
from bench.harness.result import RunResult
from bench.harness.run import DatasetSpec, RunConfig, run_benchmark
from bench.harness.workload import Target, TenantSpec
from planner.profile import DecodePoint, PrefillPoint, Profile, ProfileError

DEFAULT_PROMPT_LENGTHS = (128, 512, 1024, 2048)
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DECODE_PROMPT_TOKENS = 32
"""The decode runs' prompt: short, so that prefill barely shows in their gaps."""


class ProfileRunError(RuntimeError):
    """A measurement failed (requests failed, or nothing was measured); says which point."""


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    base_url: str
    model: str
    version: str
    """What the profile is of (a version name, ``alias@8hex``); the model served, by default."""
    prompt_lengths: tuple[int, ...] = DEFAULT_PROMPT_LENGTHS
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    prefill_requests: int = 4
    """Measured requests per prompt length (after one warm-up)."""
    output_len: int = 64
    """Tokens per decode stream."""
    api_key: str | None = None
    timeout_s: float = 600.0


async def measure(
    spec: ProfileSpec, tokenizer: Tokenizer, console: Console | None = None
) -> Profile:
    """Every prefill and decode point of ``spec``, in that order, as a ``Profile``."""
    prefill = []
    for length in sorted(set(spec.prompt_lengths)):
        result = await _run(spec, tokenizer, length, 1, 1, spec.prefill_requests, 1)
        ttft = result.summary.metrics["ttft"]
        if ttft is None or ttft.p50 <= 0:
            raise ProfileRunError(f"prefill at {length} tokens: no time to first token measured")
        prefill.append(PrefillPoint(length, length / (ttft.p50 / 1000)))
        if console is not None:
            console.print(f"prefill {length:>6} tokens: {prefill[-1].tokens_per_s:,.0f} tokens/s")
    decode = []
    for streams in sorted(set(spec.concurrency)):
        result = await _run(
            spec, tokenizer, DECODE_PROMPT_TOKENS, spec.output_len, streams, 2 * streams, streams
        )
        itl = result.summary.metrics["itl"]
        if itl is None or itl.mean <= 0:
            raise ProfileRunError(f"decode at {streams} streams: no inter-token gap measured")
        decode.append(DecodePoint(streams, itl.mean / 1000))
        if console is not None:
            console.print(f"decode {streams:>4} streams: ITL {itl.mean:.1f} ms")
    try:
        return Profile(spec.version, tuple(prefill), tuple(decode))
    except ProfileError as exc:  # e.g. a worker whose figures make no profile
        raise ProfileRunError(f"the measurements make no profile: {exc}") from exc


async def _run(
    spec: ProfileSpec,
    tokenizer: Tokenizer,
    prompt_tokens: int,
    output_tokens: int,
    concurrency: int,
    num_requests: int,
    warmup: int,
) -> RunResult:
    config = RunConfig(
        target=Target(
            base_url=spec.base_url,
            model=spec.model,
            timeout_s=spec.timeout_s,
            ignore_eos=True,
        ),
        shape=LoadShape(Arrival.CONCURRENCY, max_concurrency=concurrency),
        num_requests=num_requests,
        warmup_requests=warmup,
        dataset=DatasetSpec(
            input_len=LengthDistribution.parse(f"fixed:{prompt_tokens}"),
            output_len=LengthDistribution.parse(f"fixed:{output_tokens}"),
        ),
        tenants=(TenantSpec("profile", api_key=spec.api_key),),
        check_token_counts=False,  # a profile needs timings; the worker's tokenizer may differ
        label=f"profile {prompt_tokens}x{output_tokens} at {concurrency}",
    )
    result = await run_benchmark(config, tokenizer)
    summary = result.summary
    if summary.failed or summary.malformed or not summary.completed:
        raise ProfileRunError(
            f"{config.label}: {summary.failed} failed and {summary.malformed} malformed of "
            f"{summary.sent} requests ({summary.errors_by_type or summary.errors_by_status}); "
            "is the worker healthy, and is the prompt within its context window?"
        )
    return result


def print_profile(profile: Profile, console: Console) -> None:
    table = Table(title=f"worker profile of {profile.version}")
    for column in ("prompt tokens", "prefill tokens/s", "streams", "ITL ms"):
        table.add_column(column, justify="right")
    rows = max(len(profile.prefill), len(profile.decode))
    for i in range(rows):
        p = profile.prefill[i] if i < len(profile.prefill) else None
        d = profile.decode[i] if i < len(profile.decode) else None
        table.add_row(
            str(p.prompt_tokens) if p else "",
            f"{p.tokens_per_s:,.0f}" if p else "",
            str(d.concurrency) if d else "",
            f"{1000 * d.itl_s:.1f}" if d else "",
        )
    console.print(table)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of whole numbers: {text}"
        ) from exc
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"whole numbers >= 1, at least one: {text}")
    return values


def add_profile_parser(commands: Any) -> None:
    p = commands.add_parser(
        "profile",
        help="measure one worker's prefill and decode capacity (the planner's profile)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--base-url", required=True, help="the worker, e.g. http://127.0.0.1:8200")
    p.add_argument("--model", help="the model it serves (default: the first it lists)")
    p.add_argument("--version", help="what the profile is of (default: the model)")
    p.add_argument("--api-key")
    p.add_argument("--tokenizer", help="tokenizer.json or a model folder (default: bundled)")
    p.add_argument("--out", type=Path, required=True, help="the profile's JSON file")
    p.add_argument("--prompt-lens", type=_counts, default=DEFAULT_PROMPT_LENGTHS)
    p.add_argument("--concurrency", type=_counts, default=DEFAULT_CONCURRENCY)
    p.add_argument("--prefill-requests", type=int, default=4, help="per prompt length")
    p.add_argument("--output-len", type=int, default=64, help="tokens per decode stream")


def run_profile(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        model = args.model or asyncio.run(served_model(args.base_url, args.api_key))
        spec = ProfileSpec(
            base_url=args.base_url,
            model=model,
            version=args.version or model,
            prompt_lengths=args.prompt_lens,
            concurrency=args.concurrency,
            prefill_requests=args.prefill_requests,
            output_len=args.output_len,
            api_key=args.api_key,
        )
        if spec.prefill_requests < 1 or spec.output_len < 2:
            raise ValueError("--prefill-requests must be >= 1 and --output-len >= 2")
        profile = asyncio.run(measure(spec, tokenizer, console))
    except (DatasetError, ValueError, ProfileRunError) as exc:
        console.print(f"[red]tandem profile: {exc}[/]")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print_profile(profile, Console())
    console.print(f"saved to {args.out}")
    return 0
