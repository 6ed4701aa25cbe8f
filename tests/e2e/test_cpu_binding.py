"""Each managed worker computes on the core ``TANDEM_CPU_BINDING`` gave it: vLLM's NIXL connector
would move the model's thread (the worker process's main thread) to the last core, which
``kv_transfer/nixl_progress.py`` prevents; and on that core NIXL's threads yield to the model's
thread (their nice value). Read from ``/proc``: the affinity and nice value of each
``VLLM::Worker`` process's threads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kv_transfer.nixl_progress import NICE_ENV, thread_ids
from tests.e2e.conftest import LiveStack, model_processes, server_env

pytestmark = pytest.mark.e2e


def _allowed_cpus(pid: int) -> str:
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return next(
        line.split()[1] for line in status.splitlines() if line.startswith("Cpus_allowed_list")
    )


def test_the_model_threads_stay_on_their_own_cores(live_stack: LiveStack) -> None:
    bound = {p.pid: server_env(p, "VLLM_CPU_OMP_THREADS_BIND") for p in model_processes(live_stack)}
    assert len(bound) >= 2 and all(bound.values()), bound
    assert {pid: _allowed_cpus(pid) for pid in bound} == bound
    assert len(set(bound.values())) == len(bound), "prefill and decode on cores of their own"


def test_nixl_threads_yield_the_core_to_the_model_thread(live_stack: LiveStack) -> None:
    for worker in model_processes(live_stack):
        asked = server_env(worker, NICE_ENV)
        assert asked == "19", f"worker {worker.pid} got {NICE_ENV}={asked}"
        tids = thread_ids(worker.pid)
        names = {
            tid: Path(f"/proc/{worker.pid}/task/{tid}/comm").read_text().strip() for tid in tids
        }
        nice = {tid: os.getpriority(os.PRIO_PROCESS, tid) for tid in tids}
        own = nice[worker.pid]  # the model's thread keeps the worker's priority
        assert own < 19, f"worker {worker.pid}'s own nice value is {own}"
        ucx_async = [tid for tid in tids if names[tid] == "async"]  # UCX's, started by NIXL
        assert ucx_async and all(nice[tid] == 19 for tid in ucx_async), (names, nice)
        yielding = [tid for tid in tids if nice[tid] == 19]
        assert len(yielding) >= 3, f"NIXL's threads at nice 19: {yielding}"
        assert all(nice[tid] == own for tid in tids if names[tid].startswith("gloo")), nice
