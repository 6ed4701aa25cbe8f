"""``python -m bench.kv_transfer [affinity]``: see the package's docstring."""

from __future__ import annotations

import argparse
import asyncio

import aiohttp

from bench.kv_transfer import affinity, thread_nice, transfer
from bench.kv_transfer.common import Target, chat, served_model, split_request


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    parser.add_argument("--prefill", default="http://127.0.0.1:8100")
    parser.add_argument("--decode", default="http://127.0.0.1:8200")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts per size")
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--burst-tokens", type=int, default=2048)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    hits = commands.add_parser("affinity", help="prefix-cache hits: affinity vs round robin")
    hits.add_argument("--prefill", dest="prefills", action="append", required=True,
                      help="a prefill worker's URL; give two or more")  # fmt: skip
    hits.add_argument("--groups", type=int, default=48)
    hits.add_argument("--per-group", type=int, default=4)
    hits.add_argument("--prefix-tokens", type=int, default=512)
    hits.add_argument("--question-tokens", type=int, default=32)
    hits.add_argument("--concurrency", type=int, default=4)
    hits.add_argument("--seed", type=int, default=0, help="fixes the order of the requests")
    nice = commands.add_parser("nice", help="KV reads with NIXL's threads at nice 0 vs lowered")
    nice.add_argument("--sizes", type=int, nargs="+", default=list(thread_nice.SIZES),
                      help="prompt sizes in tokens")  # fmt: skip
    nice.add_argument("--pairs", type=int, default=8, help="pairs of requests per size")
    return parser.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        if args.command == "affinity":
            urls = [url.rstrip("/") for url in args.prefills]
            load = affinity.Workload(
                args.groups, args.per_group, args.prefix_tokens, args.question_tokens,
                args.concurrency, args.seed,
            )  # fmt: skip
            await affinity.run(session, urls, await served_model(session, urls[0]), load)
            return
        decode = args.decode.rstrip("/")
        target = Target(
            session, args.prefill.rstrip("/"), decode, await served_model(session, decode)
        )
        await split_request(target, chat(target.model, "warm up " * 50, 2, True))  # NIXL handshake
        if args.command == "nice":
            await thread_nice.run(target, args.sizes, args.pairs)
            return
        await transfer.run(target, args)


def main(argv: list[str] | None = None) -> None:
    asyncio.run(run(parse(argv)))


if __name__ == "__main__":
    main()
