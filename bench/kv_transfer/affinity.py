"""Prefix-cache hits on several prefill workers: Tandem's affinity routing vs round robin.

``groups`` system prompts (each a shared prefix of ``prefix_tokens``) are asked ``per_group``
distinct questions each, in an order shuffled by ``seed``, ``concurrency`` at a time, each a
one-token prefill: the gateway's leg 1 without keeping the KV (no decode leg follows here to
release it, and blocks held for the lease would crowd the cache). The worker is chosen by the
gateway's own policy (``kv_transfer.affinity.prefix_key`` and
``workers.registry.pick_by_affinity`` with ``DeciderConfig``'s defaults, in-flight counts
included) or by round robin, as vLLM's reference proxy does. Hits and queries are the workers'
own ``vllm:prefix_cache_*`` counters. Each policy gets fresh system prompts, so neither inherits
the other's cache; every worker first serves unmeasured warm-up batches of each size up to
``concurrency`` (a compiled vLLM worker compiles a batch shape it has not seen).

With more workers than cores, a starved worker keeps its in-flight requests for long, and the
load-aware fallback then routes past it: compare hit rates at ``--concurrency 1`` there.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench.kv_transfer.common import filler_of, metric_sum
from bench.stats import percentile
from core.messages import Endpoint, WorkerRole
from core.prompt import Prompt
from kv_transfer.affinity import prefix_key
from kv_transfer.decider import DeciderConfig
from workers.registry import Worker, pick_by_affinity

Policy = Callable[[Sequence[Worker], dict[str, Any]], Worker]


@dataclass(frozen=True, slots=True)
class Workload:
    groups: int
    per_group: int
    prefix_tokens: int
    question_tokens: int
    concurrency: int
    seed: int = 0


@dataclass(frozen=True, slots=True)
class PolicyResult:
    name: str
    hits: dict[str, float]
    queries: dict[str, float]
    requests: dict[str, int]
    latencies_s: list[float]

    @property
    def hit_rate(self) -> float:
        queries = sum(self.queries.values())
        return sum(self.hits.values()) / queries if queries else float("nan")

    def render(self) -> str:
        per_worker = "  ".join(
            f"{name}: {self.requests[name]} req, "
            f"{self.hits[name] / self.queries[name] if self.queries[name] else float('nan'):.1%}"
            for name in sorted(self.requests)
        )
        return (
            f"{self.name:<12} {self.hit_rate:>8.1%} {percentile(self.latencies_s, 50) * 1e3:>9.0f} "
            f"{percentile(self.latencies_s, 90) * 1e3:>9.0f} "
            f"{statistics.fmean(self.latencies_s) * 1e3:>9.0f}   {per_worker}"
        )


HEADER = f"{'routing':<12} {'hit rate':>8} {'p50 ms':>9} {'p90 ms':>9} {'mean ms':>9}   per worker"


def affinity_policy(config: DeciderConfig) -> Policy:
    def pick(workers: Sequence[Worker], body: dict[str, Any]) -> Worker:
        key = prefix_key(Prompt.parse(Endpoint.CHAT, body), config.affinity_prefix_chars)
        chosen = pick_by_affinity(workers, key, config.affinity_max_extra_load)
        assert chosen is not None, "every worker is healthy here"
        return chosen

    return pick


def round_robin_policy() -> Policy:
    turn = itertools.count()

    def pick(workers: Sequence[Worker], body: dict[str, Any]) -> Worker:
        return workers[next(turn) % len(workers)]

    return pick


async def bodies(
    session: aiohttp.ClientSession, url: str, model: str, load: Workload
) -> list[dict[str, Any]]:
    """The requests in sending order: every group's questions, shuffled."""
    prefix_filler = await filler_of(session, url, model, load.prefix_tokens)
    question_filler = await filler_of(session, url, model, load.question_tokens)
    systems = [
        f"{uuid.uuid4().hex} You are assistant number {g}. {prefix_filler}"
        for g in range(load.groups)
    ]
    requests = [
        one_token(model, systems[group], f"Question {uuid.uuid4().hex}: {question_filler}")
        for _ in range(load.per_group)
        for group in range(load.groups)
    ]
    random.Random(load.seed).shuffle(requests)
    return requests


def one_token(model: str, system: str, question: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 1,
        "temperature": 0,
    }


async def warm_up(
    session: aiohttp.ClientSession, urls: Sequence[str], model: str, load: Workload
) -> None:
    """Batches of 1 to ``concurrency`` requests on each worker, then the same with cache hits."""

    async def post(url: str, body: dict[str, Any]) -> None:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()

    filler = await filler_of(session, urls[0], model, load.prefix_tokens)
    for url in urls:
        systems = [f"{uuid.uuid4().hex} Warm-up. {filler}" for _ in range(load.concurrency)]
        for size in range(1, load.concurrency + 1):
            for _ in range(2):  # the second round hits the first one's prefixes
                questions = [f"Warm-up {uuid.uuid4().hex}?" for _ in range(size)]
                await asyncio.gather(
                    *(
                        post(url, one_token(model, s, q))
                        for s, q in zip(systems, questions, strict=False)
                    )
                )


async def run_policy(
    session: aiohttp.ClientSession,
    urls: Sequence[str],
    model: str,
    load: Workload,
    name: str,
    policy: Policy,
) -> PolicyResult:
    workers = [
        Worker(f"prefill-{i}", WorkerRole.PREFILL, url, healthy=True) for i, url in enumerate(urls)
    ]
    requests = await bodies(session, urls[0], model, load)
    before = await _counters(session, workers)
    counts = {worker.name: 0 for worker in workers}
    latencies: list[float] = []
    slots = asyncio.Semaphore(load.concurrency)

    async def send(body: dict[str, Any]) -> None:
        async with slots:
            worker = policy(workers, body)  # chosen when the request leaves, as the gateway does
            counts[worker.name] += 1
            with worker.lease():
                start = time.perf_counter()
                async with session.post(f"{worker.base_url}/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                    await r.read()
                latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(send(body) for body in requests))
    await asyncio.sleep(1.5)  # vLLM publishes its counters on its logging interval
    after = await _counters(session, workers)
    hits = {w.name: after[w.name][0] - before[w.name][0] for w in workers}
    queries = {w.name: after[w.name][1] - before[w.name][1] for w in workers}
    return PolicyResult(name, hits, queries, counts, latencies)


async def _counters(
    session: aiohttp.ClientSession, workers: Sequence[Worker]
) -> dict[str, tuple[float, float]]:
    counters = {}
    for worker in workers:
        hits = await metric_sum(session, worker.base_url, "vllm:prefix_cache_hits_total")
        queries = await metric_sum(session, worker.base_url, "vllm:prefix_cache_queries_total")
        counters[worker.name] = (hits, queries)
    return counters


async def run(
    session: aiohttp.ClientSession, urls: Sequence[str], model: str, load: Workload
) -> None:
    print(
        f"Prefix-cache hit rate on {len(urls)} prefill workers: {load.groups} system prompts of "
        f"~{load.prefix_tokens} tokens x {load.per_group} questions of ~{load.question_tokens} "
        f"tokens, {load.concurrency} in flight (workers' own counters):"
    )
    await warm_up(session, urls, model, load)
    print(HEADER)
    policies: list[tuple[str, Policy]] = [
        ("round robin", round_robin_policy()),
        ("affinity", affinity_policy(DeciderConfig())),
    ]
    for name, policy in policies:
        print((await run_policy(session, urls, model, load, name, policy)).render(), flush=True)
