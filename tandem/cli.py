"""The ``tandem`` console script.

tandem up | model | admin | version     the gateway's commands (gateway/cli/main.py)
tandem bench run | sweep | compare | dataset    TTFT/ITL benchmarks (bench/harness/cli.py)
tandem profile    a worker's capacity, the planner's profile (bench/profile.py)

It lives above both packages: ``bench`` drives the gateway, so the gateway may not import it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.harness.cli import add_bench_parser, run_bench
from bench.profile import add_profile_parser, run_profile
from gateway.cli import main as gateway_cli


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tandem", description="OpenAI-compatible gateway over prefill/decode vLLM pools"
    )
    commands = parser.add_subparsers(dest="command")
    gateway_cli.add_commands(commands)
    add_bench_parser(commands)
    add_profile_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "profile":
        return run_profile(args)
    code = gateway_cli.run_command(args)
    if code is None:
        parser.print_help()
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
