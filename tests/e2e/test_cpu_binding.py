"""Each managed worker computes on the core ``TANDEM_CPU_BINDING`` gave it: vLLM's NIXL connector
would move the model's thread (the worker process's main thread) to the last core, which
``kv_transfer/nixl_progress.py`` prevents. Read from ``/proc``: the affinity of each
``VLLM::Worker`` process's main thread."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import LiveStack

pytestmark = pytest.mark.e2e


def _allowed_cpus(pid: int) -> str:
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return next(
        line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    )


def _binding(worker: psutil.Process) -> str | None:
    """The ``VLLM_CPU_OMP_THREADS_BIND`` Tandem gave the worker's server (vLLM's engine does not
    pass it on to the worker process it spawns)."""
    for process in [worker, *worker.parents()]:
        bind = process.environ().get("VLLM_CPU_OMP_THREADS_BIND")
        if bind is not None:
            return bind
    return None


def test_the_model_threads_stay_on_their_own_cores(live_stack: LiveStack) -> None:
    workers = [
        p
        for p in psutil.Process(live_stack.pid).children(recursive=True)
        if p.name() == "VLLM::Worker"
    ]
    bound = {p.pid: _binding(p) for p in workers}
    assert len(bound) >= 2 and all(bound.values()), bound
    assert {pid: _allowed_cpus(pid) for pid in bound} == bound
    assert len(set(bound.values())) == len(bound), "prefill and decode on cores of their own"
