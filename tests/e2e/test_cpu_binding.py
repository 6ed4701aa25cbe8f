"""Each managed worker computes on the core ``TANDEM_CPU_BINDING`` gave it: vLLM's NIXL connector
would move the model's thread (the worker process's main thread) to the last core, which
``kv_transfer/nixl_progress.py`` prevents. Read from ``/proc``: the affinity of each
``VLLM::Worker`` process's main thread."""

from __future__ import annotations

from pathlib import Path

import pytest

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
