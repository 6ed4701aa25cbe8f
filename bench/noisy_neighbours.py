"""Noisy neighbours: does a light, latency-sensitive tenant keep its TTFT while two weighted
tenants flood the engine, and do the two get served in their weights' ratio?

Against a running gateway (``tandem up``; run it with ``TANDEM_MAX_IN_FLIGHT_PER_WORKER=8`` for
the figures in issue 19), with its admin key. Three tenants are created with fresh names:
``heavy-w1`` (weight 1), ``heavy-w3`` (weight 3), and ``light`` in ``--light-band``. Phase 1
measures the light tenant alone (``--light-rate`` short chat requests a second); phase 2 repeats
that while each heavy tenant keeps ``--streams`` streams open. It prints one table row:

    weight-3 : weight-1 served tokens (prompt + 2 x output) | light TTFT p50/p95 unloaded | flooded

    .venv/bin/python -m bench.noisy_neighbours --admin-key KEY --light-band interactive
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass, field

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

LIGHT_QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name one colour."}]
HEAVY_QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a short story about a lighthouse keeper. " * 4}
]


@dataclass
class Served:
    """What a tenant got in the flood window."""

    tokens: int = 0
    """Prompt + 2 x output tokens of requests that completed (the VTC cost weighting)."""
    errors: dict[str, int] = field(default_factory=dict)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _new_tenant(admin: httpx.AsyncClient, name: str, **plan: object) -> str:
    created = await admin.post("/admin/v1/tenants", json={"name": name, **plan})
    created.raise_for_status()
    issued = await admin.post(f"/admin/v1/tenants/{name}/keys", json={})
    issued.raise_for_status()
    return str(issued.json()["key"])


async def _ttft_s(client: openai.AsyncOpenAI, model: str) -> float | None:
    """One short streamed chat; seconds to its first content token (None on an error)."""
    started = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=LIGHT_QUESTION, max_tokens=8, temperature=0, stream=True
        )
        first: float | None = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
        return first
    except openai.APIError:
        return None


async def _light(
    client: openai.AsyncOpenAI, model: str, rate: float, duration_s: float
) -> list[float]:
    """``rate`` requests a second (open loop) for ``duration_s``; their TTFTs."""
    tasks: list[asyncio.Task[float | None]] = []
    deadline = time.perf_counter() + duration_s
    while time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(_ttft_s(client, model)))
        await asyncio.sleep(1.0 / rate)
    return [t for t in await asyncio.gather(*tasks) if t is not None]


async def _heavy_stream(
    client: openai.AsyncOpenAI, model: str, output_tokens: int, until: float, served: Served
) -> None:
    """One closed-loop stream: requests back to back until ``until``."""
    while time.perf_counter() < until:
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=HEAVY_QUESTION,
                max_tokens=output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            if usage is not None and time.perf_counter() < until:
                served.tokens += usage.prompt_tokens + 2 * usage.completion_tokens
        except openai.APIStatusError as exc:
            served.errors[str(exc.status_code)] = served.errors.get(str(exc.status_code), 0) + 1
            await asyncio.sleep(0.5)
        except openai.APIError as exc:
            served.errors[type(exc).__name__] = served.errors.get(type(exc).__name__, 0) + 1
            await asyncio.sleep(0.5)


async def run(args: argparse.Namespace) -> None:
    base = args.base_url.rstrip("/")
    suffix = uuid.uuid4().hex[:6]
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {args.admin_key}"}, timeout=10
    ) as admin:
        keys = {
            "w1": await _new_tenant(admin, f"heavy-w1-{suffix}", weight=1),
            "w3": await _new_tenant(admin, f"heavy-w3-{suffix}", weight=3),
            "light": await _new_tenant(admin, f"light-{suffix}", band=args.light_band),
        }
    clients = {
        name: openai.AsyncOpenAI(
            base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=args.duration_s + 120
        )
        for name, key in keys.items()
    }
    unloaded = await _light(clients["light"], args.model, args.light_rate, args.duration_s)
    served = {"w1": Served(), "w3": Served()}
    until = time.perf_counter() + args.warmup_s + args.duration_s
    heavy = [
        asyncio.create_task(
            _heavy_stream(clients[name], args.model, args.output_tokens, until, served[name])
        )
        for name in ("w1", "w3")
        for _ in range(args.streams)
    ]
    await asyncio.sleep(args.warmup_s)  # the flood reaches its steady state first
    for tenant in served.values():
        tenant.tokens = 0
    flooded = await _light(clients["light"], args.model, args.light_rate, args.duration_s)
    await asyncio.gather(*heavy)
    ratio = served["w3"].tokens / served["w1"].tokens if served["w1"].tokens else float("nan")
    print(
        "| light band | w3:w1 served tokens | light TTFT unloaded p50 / p95 "
        "| under the flood p50 / p95 | light ok (unloaded, flood) | heavy errors |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {args.light_band} | {ratio:.2f} "
        f"| {1000 * statistics.median(unloaded):.0f} / {1000 * _percentile(unloaded, 0.95):.0f} ms "
        f"| {1000 * statistics.median(flooded):.0f} / {1000 * _percentile(flooded, 0.95):.0f} ms "
        f"| {len(unloaded)}, {len(flooded)} | w1 {served['w1'].errors} w3 {served['w3'].errors} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--admin-key", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--light-band", choices=["interactive", "standard", "batch"], default="interactive"
    )
    p.add_argument("--light-rate", type=float, default=1.0, help="light requests a second")
    p.add_argument("--streams", type=int, default=24, help="open streams per heavy tenant")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--duration-s", type=float, default=60.0, help="each measured phase")
    p.add_argument("--warmup-s", type=float, default=10.0, help="flood before measuring")
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
