"""Each managed worker computes on the core ``TANDEM_CPU_BINDING`` gave it: vLLM's NIXL connector
would move the model's thread (the worker process's main thread) to the last core, which
``kv_transfer/nixl_progress.py`` prevents; on that core NIXL's threads yield to the model's
thread (their nice value); and a decoding server's engine process sleeps while the model steps
rather than spinning a core (``workers/vllm_busy_wait.py``). Read from ``/proc``: the affinity
and nice value of each ``VLLM::Worker`` process's threads, and its engine's time on a CPU."""

from __future__ import annotations

import os
import time
from pathlib import Path

import openai
import pytest

from bench.host_pressure import parse_schedstat
from kv_transfer.nixl_progress import NICE_ENV, thread_ids
from tests.e2e.conftest import LiveStack, counting_stream, model_processes, server_env
from workers.vllm_busy_wait import PAUSE_ENV

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


def _seconds_on_a_cpu(pid: int) -> float:
    """How long the process's main thread has run (``/proc/<pid>/schedstat``)."""
    return parse_schedstat(Path(f"/proc/{pid}/schedstat").read_text()).ran_s


def test_a_decoding_engine_sleeps_while_its_model_steps(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    # vLLM's engine process waits for each step's output from the model's process; its own
    # wait spun (measured: 0.95 of a core, beside the model's 0.95), the plugin's sleeps.
    workers = model_processes(live_stack)
    assert all(server_env(worker, PAUSE_ENV) == "100" for worker in workers)
    engines = [worker.parent() for worker in workers]
    assert all(engine is not None and engine.name() == "VLLM::EngineCore" for engine in engines)
    stream = counting_stream(client, live_stack, 80)
    tokens, started, before = 0, 0.0, {}
    for chunk in stream:
        if not (chunk.choices and chunk.choices[0].delta.content):
            continue
        tokens += 1
        if tokens == 5:  # decoding: the prompt's prefill and the hand-off are behind
            started = time.monotonic()
            before = {engine.pid: _seconds_on_a_cpu(engine.pid) for engine in engines}
        if tokens == 60:
            break
    elapsed = time.monotonic() - started
    shares = {pid: (_seconds_on_a_cpu(pid) - ran) / elapsed for pid, ran in before.items()}
    stream.close()
    assert tokens == 60 and elapsed > 0.5, (tokens, elapsed)
    assert all(share < 0.5 for share in shares.values()), shares
