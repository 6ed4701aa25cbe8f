"""One load-generator process of ``bench.overhead.scaling``: closed-loop streaming clients.

``python -m bench.overhead.scaling_load --url URL --concurrency C --start-at T ...`` keeps C
streamed chat requests open from wall-clock time ``T`` on. Requests that end inside the
measured window (``[T + warmup_s, T + warmup_s + duration_s]``) are counted; at its end it
prints one JSON line (``LoadReport``) and exits. Several such processes, started with the same
``T``, load one gateway together: a single Python client tops out near the rate one gateway
process serves, so it could not show what several processes serve.

Each client is as lean as a client can be (one aiohttp session, lines counted, nothing parsed):
its own CPU per chunk should be well under the gateway's, and it reports that CPU so the run
can tell a saturated generator from a saturated gateway. Each client first waits a random part
of one stream's length, so the streams do not stay phase-locked (see ``load.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import aiohttp
import orjson
import uvloop

from bench.overhead.load import own_cpu_s, prompt_text

DONE = b"data: [DONE]"


@dataclass(slots=True)
class LoadReport:
    """What one generator saw inside the measured window."""

    completed: int = 0
    """Streams that ended with ``[DONE]`` inside the window."""
    failed: int = 0
    """Requests that ended inside the window any other way (status, error event, broken)."""
    chunks: int = 0
    """``data:`` events of the completed streams."""
    window_s: float = 0.0
    generator_cpu_s: float = 0.0
    """This process's CPU seconds inside the window."""
    errors: dict[str, int] = field(default_factory=dict)
    """Failed requests by kind (``http_<status>``, ``error_event``, the exception's name)."""


@dataclass(frozen=True, slots=True)
class LoadArgs:
    """One generator's settings: its command-line flags (``parse`` reads them, ``command``
    writes them)."""

    url: str
    api_key: str | None
    model: str
    concurrency: int
    start_at: float
    warmup_s: float = 5.0
    duration_s: float = 15.0
    tokens: int = 32
    prompt_words: int = 100
    stagger_s: float = 1.0

    def command(self) -> list[str]:
        """The command line that runs a generator with these settings."""
        argv = [sys.executable, "-m", "bench.overhead.scaling_load"]
        for item in fields(self):
            value = getattr(self, item.name)
            if value is not None:
                argv += [f"--{item.name.replace('_', '-')}", str(value)]
        return argv


async def _one(
    session: aiohttp.ClientSession, args: LoadArgs, body: bytes, headers: dict[str, str]
) -> tuple[str | None, int]:
    """One streamed request: (None, chunks) when it ended with ``[DONE]``, else (kind, 0)."""
    chunks = 0
    try:
        async with session.post(
            args.url + "/v1/chat/completions", data=body, headers=headers
        ) as response:
            if response.status != 200:
                await response.read()
                return f"http_{response.status}", 0
            async for line in response.content:
                if line.startswith(DONE):
                    # Read to the end, as the OpenAI SDKs do: a response left with its last
                    # bytes unread closes its connection (a reset), and the next request
                    # would pay for a new one.
                    await response.content.read()
                    return None, chunks
                if line.startswith(b'data: {"error"'):
                    return "error_event", 0
                if line.startswith(b"data: "):
                    chunks += 1
    except (aiohttp.ClientError, OSError) as exc:
        return type(exc).__name__, 0
    return "no_done", 0


async def run(args: LoadArgs) -> LoadReport:
    report = LoadReport()
    window_start = args.start_at + args.warmup_s
    window_end = window_start + args.duration_s
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    cpu_at_start: list[float] = []

    async def client(slot: int, session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(random.uniform(0, args.stagger_s))
        index = slot
        while time.time() < window_end:
            body = orjson.dumps(
                {
                    "model": args.model,
                    "messages": [
                        {"role": "user", "content": prompt_text(index, args.prompt_words)}
                    ],
                    "stream": True,
                    "max_tokens": args.tokens,
                }
            )
            index += args.concurrency
            error, chunks = await _one(session, args, body, headers)
            ended = time.time()
            if not window_start <= ended <= window_end:
                continue
            if error is None:
                report.completed += 1
                report.chunks += chunks
            else:
                report.failed += 1
                report.errors[error] = report.errors.get(error, 0) + 1

    async def mark_window() -> None:
        await asyncio.sleep(max(0.0, window_start - time.time()))
        cpu_at_start.append(own_cpu_s())

    await asyncio.sleep(max(0.0, args.start_at - time.time()))
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        marker = asyncio.ensure_future(mark_window())
        await asyncio.gather(*(client(slot, session) for slot in range(args.concurrency)))
        await marker
    report.window_s = args.duration_s
    report.generator_cpu_s = own_cpu_s() - (cpu_at_start[0] if cpu_at_start else 0.0)
    return report


def load_default(name: str) -> Any:
    """The default of ``LoadArgs``'s field ``name``: its flag's default, here and in the
    tools that start a generator."""
    return next(item.default for item in fields(LoadArgs) if item.name == name)


def parse(argv: list[str]) -> LoadArgs:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.scaling_load")
    parser.add_argument("--url", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--model", required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--start-at", type=float, required=True, help="epoch seconds")
    parser.add_argument("--warmup-s", type=float, default=load_default("warmup_s"))
    parser.add_argument("--duration-s", type=float, default=load_default("duration_s"))
    parser.add_argument("--tokens", type=int, default=load_default("tokens"))
    parser.add_argument("--prompt-words", type=int, default=load_default("prompt_words"))
    parser.add_argument(
        "--stagger-s", type=float, default=load_default("stagger_s"), help="first-request spread"
    )
    ns = parser.parse_args(argv)
    return LoadArgs(**vars(ns))


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    report = uvloop.run(run(args))
    sys.stdout.write(orjson.dumps(asdict(report)).decode() + "\n")


if __name__ == "__main__":
    main()
