"""Send N streaming chat requests through the gateway and directly to the decode worker, and
print TTFT and ITL percentiles for both.

    TANDEM_API_KEY=tdm-... python -m bench.gateway_vs_direct --gateway http://127.0.0.1:8000 \
        --direct http://127.0.0.1:8200 --requests 20 --max-tokens 64

The key is a tenant's (``tandem admin keys issue NAME``); the worker ignores it.

Definitions (vLLM ``bench serve``'s): TTFT = request sent -> first chunk with content;
ITL = gap between consecutive content chunks, pooled over all requests. Through the gateway the
request is disaggregated (prefill worker, KV over NIXL, decode worker); directly, the decode
worker prefills the prompt itself. Runs alternate A, B, A, B so drift hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three good habits for a software engineer?",
    "Describe how a bicycle works.",
)


@dataclass
class Samples:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    errors: int = 0


async def one_request(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: str,
    max_tokens: int,
    into: Samples,
) -> None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    last: float | None = None
    async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            into.errors += 1
            return
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                into.errors += 1
                return
            if chunk.get("usage"):
                into.output_tokens += chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if not (choices and choices[0].get("delta", {}).get("content")):
                continue
            now = time.perf_counter()
            if last is None:
                into.ttft_s.append(now - sent)
            else:
                into.itl_s.append(now - last)
            last = now


async def discover_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(f"{base_url}/v1/models") as response:
        return str((await response.json())["data"][0]["id"])


async def run(args: argparse.Namespace) -> dict[str, Samples]:
    targets = {"gateway": args.gateway.rstrip("/"), "direct": args.direct.rstrip("/")}
    results = {name: Samples() for name in targets}
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600),
        headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else None,
    ) as session:
        model = await discover_model(session, targets["gateway"])
        for url in targets.values():  # warm-up: first NIXL handshake, caches, allocators
            await one_request(session, url, model, "Hello", 4, Samples())
        semaphore = asyncio.Semaphore(args.concurrency)

        async def bounded(name: str, i: int) -> None:
            async with semaphore:
                prompt = PROMPTS[i % len(PROMPTS)]
                await one_request(
                    session, targets[name], model, prompt, args.max_tokens, results[name]
                )

        for i in range(args.requests):
            order = ("gateway", "direct") if i % 2 == 0 else ("direct", "gateway")
            if args.concurrency == 1:
                for name in order:
                    await bounded(name, i)
        if args.concurrency > 1:
            for name in ("gateway", "direct"):
                await asyncio.gather(*(bounded(name, i) for i in range(args.requests)))
    return results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def report(results: dict[str, Samples]) -> str:
    lines = [
        f"{'target':<8} {'metric':<5} {'n':>5} {'mean':>8} {'p50':>8} {'p90':>8} {'p99':>8}  (ms)"
    ]
    for name, samples in results.items():
        for metric, values in (("TTFT", samples.ttft_s), ("ITL", samples.itl_s)):
            ms = [v * 1000 for v in values]
            mean = statistics.fmean(ms) if ms else float("nan")
            lines.append(
                f"{name:<8} {metric:<5} {len(ms):>5} {mean:>8.1f} {percentile(ms, 50):>8.1f} "
                f"{percentile(ms, 90):>8.1f} {percentile(ms, 99):>8.1f}"
            )
        lines.append(
            f"{name:<8} requests ok={len(samples.ttft_s)} errors={samples.errors} "
            f"output_tokens={samples.output_tokens}"
        )
    gateway, direct = results["gateway"], results["direct"]
    if gateway.ttft_s and direct.ttft_s:
        delta = (percentile(gateway.ttft_s, 50) - percentile(direct.ttft_s, 50)) * 1000
        lines.append(f"TTFT p50 gateway - direct: {delta:+.1f} ms")
    if gateway.itl_s and direct.itl_s:
        delta = (percentile(gateway.itl_s, 50) - percentile(direct.itl_s, 50)) * 1000
        lines.append(f"ITL  p50 gateway - direct: {delta:+.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--direct", default="http://127.0.0.1:8200", help="decode worker URL")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="a tenant key for the gateway (default $TANDEM_API_KEY)",
    )
    args = parser.parse_args(argv)
    print(report(asyncio.run(run(args))))


if __name__ == "__main__":
    main()
