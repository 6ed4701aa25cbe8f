"""Managed workers' KV caches sit on transparent huge pages (``THP_MEM_ALLOC_ENABLE``, which
``workers/process.py`` sets): the kernel copy that moves KV between same-host workers pins and
maps the source's pages on every read, and runs about 3x faster from huge ones
(docs/ARCHITECTURE.md, KV transport). Read from ``/proc``: each ``VLLM::Worker`` process's
anonymous huge pages against the KV cache Tandem sized for it."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from bench.kv_transfer.cma_ceiling import huge_bytes
from tests.e2e.conftest import LiveStack, model_processes, server_env

pytestmark = pytest.mark.e2e

GIB = 1 << 30


def _thp_mode() -> str:
    """The bracketed choice in ``/sys/kernel/mm/transparent_hugepage/enabled``."""
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1 : text.index("]")]


def _kv_cache_bytes(worker: psutil.Process) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` (GiB) as Tandem gave it to the worker's server."""
    space = server_env(worker, "VLLM_CPU_KVCACHE_SPACE")
    assert space is not None, f"worker {worker.pid} has no VLLM_CPU_KVCACHE_SPACE"
    return int(space) * GIB


def test_the_workers_kv_caches_are_on_huge_pages(live_stack: LiveStack) -> None:
    mode = _thp_mode()
    assert mode in ("madvise", "always"), (
        f"transparent huge pages are '{mode}' on this kernel: workers' KV caches cannot get "
        "them (echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)"
    )
    workers = model_processes(live_stack)
    assert len(workers) >= 2
    huge = {p.pid: (huge_bytes(p.pid), _kv_cache_bytes(p)) for p in workers}
    assert all(on_huge >= kv for on_huge, kv in huge.values()), huge
