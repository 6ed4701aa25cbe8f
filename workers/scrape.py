"""Selected vLLM counters from every worker, re-exported on the gateway's ``/metrics``.

Read at scrape time (no background polling): one ``GET /metrics`` per worker, in parallel, with a
short timeout; a worker that does not answer is left out of that scrape. The figures are the
workers' own: prefix-cache hits per prefill worker (what cache-affinity routing is for), KV bytes
and time moved over NIXL per decode worker, preemptions, KV-cache usage.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from workers.registry import Worker, WorkerSource

# vLLM sample name -> (Tandem metric name, Prometheus type, help)
_EXPORTED = {
    "vllm:prefix_cache_queries_total": (
        "tandem_worker_prefix_cache_queries_total", "counter",
        "Prompt tokens looked up in the worker's prefix cache.",
    ),
    "vllm:prefix_cache_hits_total": (
        "tandem_worker_prefix_cache_hits_total", "counter",
        "Prompt tokens found in the worker's prefix cache.",
    ),
    "vllm:nixl_bytes_transferred_sum": (
        "tandem_worker_kv_transfer_bytes_total", "counter",
        "KV bytes the worker moved over NIXL.",
    ),
    "vllm:nixl_xfer_time_seconds_sum": (
        "tandem_worker_kv_transfer_seconds_total", "counter",
        "Time the worker spent in NIXL transfers.",
    ),
    "vllm:nixl_xfer_time_seconds_count": (
        "tandem_worker_kv_transfers_total", "counter",
        "NIXL transfers the worker completed.",
    ),
    "vllm:num_preemptions_total": (
        "tandem_worker_preemptions_total", "counter",
        "Requests the worker's scheduler preempted (their KV freed for higher-priority or "
        "older work; they resume by recomputing it).",
    ),
    "vllm:kv_cache_usage_perc": (
        "tandem_worker_kv_cache_usage_ratio", "gauge",
        "Share of the worker's KV cache in use.",
    ),
}  # fmt: skip


async def scrape_workers(
    session: aiohttp.ClientSession, pools: Sequence[WorkerSource], timeout_s: float = 2.0
) -> str:
    """Prometheus text for the exported counters of every healthy worker."""
    workers = [worker for pool in pools for worker in pool.workers if worker.healthy]
    texts = await asyncio.gather(
        *(fetch_metrics_text(session, worker, timeout_s) for worker in workers)
    )
    values: dict[str, list[str]] = {name: [] for name, _, _ in _EXPORTED.values()}
    for worker, text in zip(workers, texts, strict=True):
        if text is None:
            continue
        totals: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _EXPORTED:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
        for vllm_name, total in totals.items():
            name = _EXPORTED[vllm_name][0]
            values[name].append(f'{name}{{worker="{worker.name}",role="{worker.role}"}} {total}')
    lines: list[str] = []
    for name, kind, help_text in _EXPORTED.values():
        if values[name]:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *values[name]]
    return "\n".join(lines) + "\n" if lines else ""


async def fetch_metrics_text(
    session: aiohttp.ClientSession, worker: Worker, timeout_s: float
) -> str | None:
    """A worker's ``/metrics`` text, or None if it does not answer 200 within ``timeout_s``."""
    try:
        async with session.get(
            f"{worker.base_url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None  # a slow or gone worker must not fail the gateway's own scrape
