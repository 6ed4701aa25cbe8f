"""Talking to a live prefill/decode pair the way the gateway does: prompts, the two legs, timing."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kv_transfer.connector import ConnectorConfig
from kv_transfer.handle import TransferHandle
from kv_transfer.legs import decode_leg_body, prefill_leg_body

FILLER = "the quick brown fox jumps over the lazy dog and "


@dataclass
class Target:
    session: aiohttp.ClientSession
    prefill: str
    decode: str
    model: str


@dataclass(frozen=True, slots=True)
class SplitTiming:
    """One disaggregated request, timed from the client's side of both legs."""

    prefill_leg_s: float
    """Leg 1: the prompt computed on the prefill worker, its KV kept there."""
    ttft_s: float
    """From leg 1 sent to leg 2's first content token."""
    arrivals: list[float]

    @property
    def handoff_s(self) -> float:
        """Leg 2 to its first token: the KV transfer and the first decode step."""
        return self.ttft_s - self.prefill_leg_s


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        return str((await response.json())["data"][0]["id"])


async def metric_sum(session: aiohttp.ClientSession, url: str, name: str) -> float:
    """The sum of a metric's samples over all label sets on a worker's ``/metrics``."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.e+-]+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.M))


async def count_tokens(session: aiohttp.ClientSession, url: str, model: str, text: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    async with session.post(f"{url}/tokenize", json=body) as response:
        return int((await response.json())["count"])


async def filler_of(session: aiohttp.ClientSession, url: str, model: str, num_tokens: int) -> str:
    """Filler text of about ``num_tokens`` tokens."""
    per_repeat = max(1, await count_tokens(session, url, model, FILLER * 20) // 20)
    return FILLER * max(1, num_tokens // per_repeat)


async def prompt_of(target: Target, num_tokens: int) -> str:
    """A prompt of about ``num_tokens`` tokens (chat template included) that no prefix cache
    holds: it starts with a fresh id."""
    filler = await filler_of(target.session, target.decode, target.model, num_tokens)
    return f"{uuid.uuid4().hex} {filler}"


def chat(model: str, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


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


async def prefill_leg(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> TransferHandle:
    """Leg 1 on the prefill worker at ``url``; the handle it returns."""
    async with session.post(f"{url}/v1/chat/completions", json=prefill_leg_body(body)) as r:
        r.raise_for_status()
        lease_s = ConnectorConfig().kv_lease_s  # what `tandem up` gives its workers
        return TransferHandle.from_prefill_response(await r.json(), url, lease_s=lease_s)


async def split_request(target: Target, body: dict[str, Any]) -> SplitTiming:
    """Both legs, as the gateway sends them."""
    sent = time.perf_counter()
    handle = await prefill_leg(target.session, target.prefill, body)
    prefill_s = time.perf_counter() - sent
    ttft, arrivals = await stream_times(target, target.decode, decode_leg_body(body, handle), sent)
    return SplitTiming(prefill_s, ttft, arrivals)
