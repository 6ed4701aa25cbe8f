"""``python -m bench.overhead``: what the gateway adds, isolated with a fast fake engine.

    python -m bench.overhead                       # 1, 64, 512 streams, all targets: ~7 min
    python -m bench.overhead --profile gateway.svg --out-json overhead.json
    python -m bench.overhead --real-gateway http://127.0.0.1:8000 \\
        --real-engine http://127.0.0.1:8200 --api-key tdm-... --pid 1234 --concurrency 1,4
    python -m bench.overhead --tracing             # tracing off/on at 64 streams, 3 rounds

The same closed-loop load (N concurrent chat streams, ``--tokens`` tokens each) goes directly to
the fake decode engine, through a bare SSE relay (``bare_relay``: the floor), through Tandem (two
legs, and colocated), and through LiteLLM's proxy when it is installed (``--litellm``, default
``.venv-litellm/bin/litellm``). Reported per target and level: TTFT/ITL p50/p99 and what the
server adds over direct, the server's CPU per request and per streamed chunk, requests/s and
errors; then Tandem/relay ratios (issue 24's target: at most 2x), Tandem/LiteLLM ratios, the
split of CPU into a fixed part per request and a part per chunk next to the anchors in
``measure.ANCHORS``, and (with ``--profile``) where the gateway's time goes. See ``runs``,
``measure`` and ``servers`` for the definitions and the configurations. ``--tracing``
measures what request tracing costs instead (``trace_cost``): tracing on against off in
alternating rounds, and the calls tracing off still makes.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from bench.overhead import report
from bench.overhead.fake_vllm import Timing
from bench.overhead.load import LoadSpec
from bench.overhead.runs import (
    ENGINE_CORE,
    SERVER_CORE,
    FakeRunConfig,
    RunOutput,
    run_fake,
    run_real,
)
from bench.overhead.trace_cost import (
    GATEWAY_SPANS_PER_REQUEST,
    TracingOutput,
    TracingRunConfig,
    TracingRunError,
    run_tracing,
)
from workers.model import prepare_in_subprocess

TARGETS = (
    "direct",
    "relay",
    "tandem-2leg",
    "tandem-colocated",
    "tandem-2proc",
    "tandem-redis",
    "tandem-moderated",
    "tandem-policy",
    "litellm",
)
DEFAULT_LITELLM = Path(".venv-litellm/bin/litellm")
T = TypeVar("T")


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        levels = []
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,64,512, not {text!r}")
    return levels


def _targets(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = sorted(set(names) - set(TARGETS))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"targets are among {', '.join(TARGETS)}, not {unknown}")
    return names


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.overhead",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--concurrency", type=_levels, help="levels (default 1,64,512; real: 1,4; tracing: 64)"
    )
    p.add_argument("--targets", type=_targets, help=f"{','.join(TARGETS)} (default: all)")
    p.add_argument("--duration-s", type=float, default=15.0, help="measured phase per level")
    p.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--itl-ms", type=float, default=20.0, help="fake engine: gap between tokens")
    p.add_argument("--ttft-ms", type=float, default=0.0, help="fake engine: first token")
    p.add_argument("--kv-ttft-ms", type=float, default=0.0, help="fake: decode leg's first token")
    p.add_argument("--prompt-words", type=int, help="prompt length (default 100; real: 300)")
    p.add_argument("--max-requests", type=int, default=20_000, help="cap per measured phase")
    p.add_argument(
        "--burst", action="store_true", help="start each level's streams together (see load.py)"
    )
    p.add_argument("--no-auth", action="store_true", help="Tandem without keys and quotas")
    p.add_argument(
        "--tokenizer-dir",
        help="Tandem counts prompts with this folder's tokenizer.json ('bundled': the bundled "
        "model's; default: 4 characters a token, as for external workers)",
    )
    p.add_argument("--litellm", type=Path, help=f"litellm binary (default {DEFAULT_LITELLM})")
    p.add_argument("--profile", type=Path, help="py-spy profile: .svg, .json (speedscope), .txt")
    p.add_argument("--profile-concurrency", type=int, default=64)
    p.add_argument("--fit-concurrency", type=int, default=64, help="0: no 1-token runs")
    p.add_argument("--no-fake-check", action="store_true", help="skip the fake-alone check")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--keep-work-dir", action="store_true", help="keep server logs and state")
    p.add_argument("--out-json", type=Path, help="write every figure here")
    tracing = p.add_argument_group("tracing: what request tracing costs (see trace_cost)")
    tracing.add_argument(
        "--tracing", action="store_true", help="instead: tandem-2leg and tandem-traced in turns"
    )
    tracing.add_argument("--rounds", type=int, default=3, help="turns per gateway and level")
    real = p.add_argument_group("real stack (part b): measure servers someone else runs")
    real.add_argument("--real-gateway", help="the gateway's URL")
    real.add_argument("--real-engine", help="the decode worker's URL (direct)")
    real.add_argument("--api-key", help="a tenant key for the gateway")
    real.add_argument("--pid", type=int, help="the gateway's pid (for its CPU)")
    real.add_argument("--model", help="model name (default: the engine's first)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    console = Console(width=200)
    real = args.real_gateway or args.real_engine
    if real and not (args.real_gateway and args.real_engine):
        console.print("[red]--real-gateway and --real-engine go together[/]")
        return 2
    spec = LoadSpec(
        prompt_words=args.prompt_words or (300 if real else 100),
        num_tokens=args.tokens,
        duration_s=args.duration_s,
        max_requests=args.max_requests,
        stagger=not args.burst,
    )
    if args.tracing:
        if real or args.targets or args.profile:
            console.print("[red]--tracing runs its own two gateways: no --real-*, --targets, "
                          "--profile[/]")  # fmt: skip
            return 2
        return _main_tracing(args, argv, spec, console)
    levels = args.concurrency or ([1, 4] if real else [1, 64, 512])
    import uvloop  # the load generator's loop: the cheapest per event

    started = time.time()
    config: dict[str, Any]
    try:
        if real:
            config = {"mode": "real", "gateway": args.real_gateway}
            output = uvloop.run(
                _stoppable(
                    run_real(
                        args.real_gateway, args.real_engine, args.api_key, args.pid,
                        args.model, levels, spec, console,
                    )
                )
            )  # fmt: skip
        else:
            run_config = _fake_config(args, levels, spec, console)
            config = {
                "mode": "fake",
                "timing": {
                    "tokens": args.tokens, "itl_ms": args.itl_ms, "ttft_ms": args.ttft_ms,
                    "kv_ttft_ms": args.kv_ttft_ms,
                },
                "targets": list(run_config.targets),
                "auth": run_config.auth,
                "litellm": _litellm_version(run_config.litellm),
            }  # fmt: skip
            output = uvloop.run(_stoppable(run_fake(run_config, console)))
    except asyncio.CancelledError:
        console.print("stopped: every server this run started is stopped")
        return 130
    config.update(levels=levels, prompt_words=spec.prompt_words, duration_s=spec.duration_s)
    _print(console, output, spec)
    if args.out_json:
        report.write_json(args.out_json, _payload(config, output, time.time() - started))
        console.print(f"figures written to {args.out_json}")
    return 0


def _main_tracing(
    args: argparse.Namespace, argv: Sequence[str], spec: LoadSpec, console: Console
) -> int:
    import uvloop

    if args.rounds < 1:
        console.print("[red]--rounds takes a positive integer[/]")
        return 2
    config = TracingRunConfig(
        levels=args.concurrency or [64],
        spec=spec,
        timing=Timing(
            num_tokens=args.tokens,
            itl_s=args.itl_ms / 1000,
            ttft_s=args.ttft_ms / 1000,
            kv_ttft_s=args.kv_ttft_ms / 1000,
        ),
        rounds=args.rounds,
        auth=not args.no_auth,
        fit_concurrency=args.fit_concurrency or None,
        pin=not args.no_pin,
        keep_work_dir=args.keep_work_dir,
    )
    started = time.time()
    try:
        output = uvloop.run(_stoppable(run_tracing(config, console)))
    except asyncio.CancelledError:
        console.print("stopped: every server this run started is stopped")
        return 130
    except TracingRunError as exc:
        console.print(f"[red]no tracing figures: {exc}[/]")
        return 1
    _print_tracing(console, output)
    if args.out_json:
        payload = _tracing_payload(config, argv, output, time.time() - started)
        report.write_json(args.out_json, payload)
        console.print(f"figures written to {args.out_json}")
    return 0


async def _stoppable(run: Coroutine[Any, Any, T]) -> T:
    """``run``, cancelled by SIGINT or SIGTERM so that its servers are stopped on the way out
    (a background job's SIGINT is ignored, and SIGTERM would skip every ``finally``)."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in signals}
    if task is not None:
        for sig in signals:
            loop.add_signal_handler(sig, task.cancel)
    try:
        return await run
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
            if previous[sig] is not None:  # None: set outside Python, nothing to restore
                signal.signal(sig, previous[sig])


def _fake_config(
    args: argparse.Namespace, levels: list[int], spec: LoadSpec, console: Console
) -> FakeRunConfig:
    litellm = args.litellm or (DEFAULT_LITELLM if DEFAULT_LITELLM.exists() else None)
    targets = args.targets or list(TARGETS)
    if "litellm" in targets and litellm is None:
        console.print(
            f"LiteLLM skipped: no {DEFAULT_LITELLM} (python3 -m venv .venv-litellm && "
            ".venv-litellm/bin/pip install 'litellm[proxy]', or pass --litellm PATH)"
        )
    py_spy = Path(sys.executable).parent / "py-spy"
    if args.profile and not py_spy.exists():
        # Said before any target runs, not after the first one has.
        raise SystemExit(f"--profile needs {py_spy}: scripts/install --dev installs py-spy")
    return FakeRunConfig(
        levels=levels,
        spec=spec,
        timing=Timing(
            num_tokens=args.tokens,
            itl_s=args.itl_ms / 1000,
            ttft_s=args.ttft_ms / 1000,
            kv_ttft_s=args.kv_ttft_ms / 1000,
        ),
        targets=[t for t in targets if t != "litellm" or litellm is not None],
        auth=not args.no_auth,
        litellm=litellm,
        profile=args.profile.resolve() if args.profile else None,
        profile_concurrency=args.profile_concurrency,
        fit_concurrency=args.fit_concurrency or None,
        fake_check=not args.no_fake_check,
        pin=not args.no_pin,
        py_spy=py_spy,
        keep_work_dir=args.keep_work_dir,
        tokenizer_dir=_tokenizer_dir(args.tokenizer_dir),
    )


def _tokenizer_dir(arg: str | None) -> Path | None:
    if arg is None:
        return None
    if arg == "bundled":
        return prepare_in_subprocess(None, None).path
    path = Path(arg).resolve()
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(f"--tokenizer-dir: {path} has no tokenizer.json")
    return path


def _litellm_version(binary: Path | None) -> str | None:
    if binary is None:
        return None
    python = binary.parent / "python"
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def _print(console: Console, output: RunOutput, spec: LoadSpec) -> None:
    for note in output.notes:
        console.print(note)
    for name, paths in output.paths.items():
        console.print(f"serving paths counted by {name}'s /metrics (path/reason/outcome): {paths}")
    where = (
        f"server on core {SERVER_CORE}, fake engines + load generator on core {ENGINE_CORE}"
        if output.pinned
        else "no pinning (a real stack's workers count as others)"
    )
    tables = [
        report.latency_table(output.results),
        report.cpu_table(output.results, where),
        report.memory_table(output.results),
        # Issue 24's target: Tandem at most 2x the bare relay's CPU per request (B/A <= 2).
        report.versus_table(
            output.results, "relay", "tandem-colocated", " - issue 24: B/A at most 2x"
        ),
        report.versus_table(
            output.results, "relay", "tandem-moderated", " - output moderation on: at most 2x"
        ),
        report.versus_table(output.results, "relay", "tandem-2leg"),
        report.versus_table(
            output.results, "tandem-colocated", "tandem-2proc", " - 1 vs 2 gateway processes"
        ),
        report.versus_table(
            output.results, "tandem-colocated", "tandem-redis", " - the shared stores in Redis"
        ),
        report.versus_table(output.results, "tandem-2leg", "litellm"),
    ]
    if output.extra:
        tables.append(report.cpu_table(output.extra, where))
    if output.fits:
        chunks = next((r.chunks_per_request for r in output.results if r.target != "direct"), 34)
        how = "fit from 1-token and full-length runs at the same concurrency"
        tables.append(report.cost_table(output.fits, chunks, how))
    report.print_all(console, tables)
    if output.engine_stats:
        console.print(f"fake engines served: {output.engine_stats}")
    if output.profile is not None:
        report.print_all(console, report.profile_tables(output.profile, "gateway profile"))


def _print_tracing(console: Console, output: TracingOutput) -> None:
    for note in output.notes:
        console.print(note)
    for name, paths in output.paths.items():
        console.print(f"serving paths counted by {name}'s /metrics (path/reason/outcome): {paths}")
    where = (
        f"gateways on core {SERVER_CORE}; fake engines, load generator, receiver on core "
        f"{ENGINE_CORE}"
        if output.pinned
        else "no pinning"
    )
    tables = [
        report.latency_table(output.results),
        report.cpu_table([*output.results, *output.extra], where),
    ]
    if output.fits:
        chunks = output.costs[0].off.chunks_per_request if output.costs else 34
        tables.append(report.cost_table(output.fits, chunks, "fit from the pooled rounds"))
    tables.append(report.tracing_table(output.costs, output.fits))
    report.print_all(console, tables)
    if output.engine_stats:
        console.print(f"fake engines served: {output.engine_stats}")
    spans = output.spans
    if spans is not None:
        per_request = spans.received / spans.traced_requests if spans.traced_requests else 0.0
        receiver_ms = (output.receiver_cpu_s or 0.0) * 1000 / max(1, spans.traced_requests)
        console.print(
            f"OTLP receiver: {spans.received} spans in {spans.exports} exports from "
            f"{spans.traced_requests} traced requests ({per_request:.2f} per request, "
            f"{GATEWAY_SPANS_PER_REQUEST} expected); its own CPU {receiver_ms:.3f} ms per traced "
            "request (a collector's, not the gateway's)"
        )


def _tracing_payload(
    config: TracingRunConfig, argv: Sequence[str], output: TracingOutput, elapsed_s: float
) -> dict[str, Any]:
    spans = output.spans
    return {
        "config": {
            "mode": "tracing",
            "command": " ".join(["python", "-m", "bench.overhead", *argv]),
            "levels": list(config.levels),
            "rounds": config.rounds,
            "prompt_words": config.spec.prompt_words,
            "duration_s": config.spec.duration_s,
            "tokens": config.spec.num_tokens,
            "itl_ms": config.timing.itl_s * 1000,
            "auth": config.auth,
            "fit_concurrency": config.fit_concurrency,
        },
        "elapsed_s": elapsed_s,
        "notes": output.notes,
        "tracing": [cost.to_dict() for cost in output.costs],
        "off_path_us_per_request": output.off_path_us,
        "spans": None
        if spans is None
        else {
            "received": spans.received,
            "exports": spans.exports,
            "traced_requests": spans.traced_requests,
            "expected": spans.expected,
        },
        "receiver_cpu_s": output.receiver_cpu_s,
        **_measured(output),
    }


def _payload(config: dict[str, Any], output: RunOutput, elapsed_s: float) -> dict[str, Any]:
    return {
        "config": config,
        "elapsed_s": elapsed_s,
        "notes": output.notes,
        **_measured(output),
        "profile": output.profile.to_dict() if output.profile else None,
    }


def _measured(output: RunOutput | TracingOutput) -> dict[str, Any]:
    """What both kinds of run measured: levels, fits, serving paths, the engines' counts."""
    return {
        "results": [r.to_dict() for r in output.results],
        "extra": [r.to_dict() for r in output.extra],
        "fits": {
            name: {"ms_per_request": c.ms_per_request, "ms_per_chunk": c.ms_per_chunk}
            for name, c in output.fits.items()
        },
        "paths": output.paths,
        "engine_stats": output.engine_stats,
    }
