"""What moving KV between workers costs, and what it buys.

    python -m bench.kv_transfer --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Runs against a live prefill/decode pair (``tandem up``), talking to the workers directly with
the gateway's own two legs, so the figures are the transfer's and not the gateway's.

1. For prompts of about 256, 1k, 2k and 4k tokens: KV bytes and transfer time (the decode
   worker's ``vllm:nixl_bytes_transferred`` / ``vllm:nixl_xfer_time_seconds`` deltas),
   throughput, this machine's memcpy time for the same bytes (numpy, same run) and the ratio;
   TTFT split (leg 1 + leg 2 to the first token) vs colocated (one worker does both).
2. Interference: ITL of running decode streams while a burst of long prompts arrives, with the
   burst prefilled on the prefill worker (disaggregated) or on the decode worker (colocated).

Every prompt starts with a fresh id, so no prefix cache hides work.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import re
import statistics
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson

from kv_transfer.handle import TransferHandle
from kv_transfer.legs import decode_leg_body, prefill_leg_body

FILLER = "the quick brown fox jumps over the lazy dog and "
SIZES = (256, 1024, 2048, 4096)


@dataclass
class Target:
    session: aiohttp.ClientSession
    prefill: str
    decode: str
    model: str


async def metric_sum(target: Target, url: str, name: str) -> float:
    async with target.session.get(f"{url}/metrics") as response:
        text = await response.text()
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.e+-]+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


async def count_tokens(target: Target, text: str) -> int:
    body = {"model": target.model, "messages": [{"role": "user", "content": text}]}
    async with target.session.post(f"{target.decode}/tokenize", json=body) as response:
        return int((await response.json())["count"])


async def prompt_of(target: Target, num_tokens: int) -> str:
    """A unique prompt of about ``num_tokens`` tokens (chat template included)."""
    per_repeat = max(1, await count_tokens(target, FILLER * 20) // 20)
    text = f"{uuid.uuid4().hex} " + FILLER * max(1, num_tokens // per_repeat)
    return text


def chat(target: Target, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    return body


async def stream_times(
    target: Target, url: str, body: dict[str, Any], sent: float
) -> tuple[float, list[float]]:
    """TTFT (from ``sent``) and the arrival times of content chunks."""
    arrivals: list[float] = []
    async with target.session.post(f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                arrivals.append(time.perf_counter())
    return (arrivals[0] - sent if arrivals else float("nan")), arrivals


async def split_request(target: Target, body: dict[str, Any]) -> tuple[float, list[float]]:
    sent = time.perf_counter()
    leg1 = prefill_leg_body(body)
    async with target.session.post(f"{target.prefill}/v1/chat/completions", json=leg1) as r:
        r.raise_for_status()
        handle = TransferHandle.from_prefill_response(await r.json(), "prefill")
    return await stream_times(target, target.decode, decode_leg_body(body, handle), sent)


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    source = np.ones(max(1, num_bytes), dtype=np.uint8)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return best


async def transfer_table(target: Target) -> list[str]:
    rows = [
        f"{'tokens':>7} {'KV MB':>8} {'xfer ms':>8} {'GB/s':>6} {'memcpy ms':>9} "
        f"{'xfer/memcpy':>11} {'TTFT split ms':>13} {'TTFT coloc ms':>13}"
    ]
    for size in SIZES:
        text = await prompt_of(target, size)
        tokens = await count_tokens(target, text)
        bytes_before = await metric_sum(target, target.decode, "vllm:nixl_bytes_transferred_sum")
        time_before = await metric_sum(target, target.decode, "vllm:nixl_xfer_time_seconds_sum")
        ttft_split, _ = await split_request(target, chat(target, text, 4, True))
        await asyncio.sleep(1.5)  # vLLM publishes connector stats on its logging interval
        kv_bytes = await metric_sum(target, target.decode, "vllm:nixl_bytes_transferred_sum")
        xfer_s = await metric_sum(target, target.decode, "vllm:nixl_xfer_time_seconds_sum")
        kv_bytes, xfer_s = kv_bytes - bytes_before, xfer_s - time_before
        other = await prompt_of(target, size)
        ttft_coloc, _ = await stream_times(
            target, target.decode, chat(target, other, 4, True), time.perf_counter()
        )
        copy_s = memcpy_seconds(int(kv_bytes))
        throughput = kv_bytes / xfer_s / 1e9 if xfer_s > 0 else float("nan")
        ratio = xfer_s / copy_s if copy_s > 0 and xfer_s > 0 else float("nan")
        rows.append(
            f"{tokens:>7} {kv_bytes / 1e6:>8.1f} {xfer_s * 1e3:>8.1f} {throughput:>6.2f} "
            f"{copy_s * 1e3:>9.2f} {ratio:>11.1f} {ttft_split * 1e3:>13.0f} "
            f"{ttft_coloc * 1e3:>13.0f}"
        )
    return rows


async def interference(target: Target, split: bool, burst: int, burst_tokens: int) -> list[float]:
    """ITL of 4 running streams while ``burst`` long prompts arrive; returns the gaps (s)."""

    def story() -> dict[str, Any]:
        return chat(target, f"{uuid.uuid4().hex} Tell a long story.", 160, True)

    running = [
        asyncio.create_task(stream_times(target, target.decode, story(), time.perf_counter()))
        for _ in range(4)
    ]
    await asyncio.sleep(1.0)  # let them reach steady decoding
    burst_start = time.perf_counter()
    prompts = [await prompt_of(target, burst_tokens) for _ in range(burst)]
    if split:
        burst_calls = [split_request(target, chat(target, p, 1, True)) for p in prompts]
    else:
        burst_calls = [
            stream_times(target, target.decode, chat(target, p, 1, True), time.perf_counter())
            for p in prompts
        ]
    await asyncio.gather(*burst_calls)
    burst_end = time.perf_counter()
    gaps: list[float] = []
    for _, arrivals in await asyncio.gather(*running):
        gaps += [
            later - earlier
            for earlier, later in itertools.pairwise(arrivals)
            if burst_start <= later <= burst_end + 0.5
        ]
    return gaps


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def run(args: argparse.Namespace) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async with session.get(f"{args.decode}/v1/models") as response:
            model = str((await response.json())["data"][0]["id"])
        target = Target(session, args.prefill.rstrip("/"), args.decode.rstrip("/"), model)
        await split_request(target, chat(target, "warm up " * 50, 2, True))  # NIXL handshake
        print("KV transfer by prompt size (decode worker's NIXL counters; memcpy: numpy):")
        print("\n".join(await transfer_table(target)))
        print(f"\nITL of 4 running streams during a burst of {args.burst} x ~{args.burst_tokens}"
              "-token prompts:")  # fmt: skip
        print(f"{'burst prefilled on':<22} {'gaps':>5} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7}")
        for label, split in (("prefill worker (split)", True), ("decode worker (coloc)", False)):
            gaps = [
                g * 1e3 for g in await interference(target, split, args.burst, args.burst_tokens)
            ]
            print(
                f"{label:<22} {len(gaps):>5} {percentile(gaps, 50):>7.1f} "
                f"{percentile(gaps, 90):>7.1f} {percentile(gaps, 99):>7.1f}"
            )
            if gaps:
                print(f"{'':<22} mean {statistics.fmean(gaps):.1f} ms")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", default="http://127.0.0.1:8100")
    parser.add_argument("--decode", default="http://127.0.0.1:8200")
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--burst-tokens", type=int, default=2048)
    asyncio.run(run(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
