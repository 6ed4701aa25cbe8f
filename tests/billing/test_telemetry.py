"""The telemetry loop: which basis each worker's busy time comes from, with fakes behind
NVML and the process table; the real psutil collector; the owned loop."""

from __future__ import annotations

import asyncio
import itertools
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence

import psutil
import pytest

from billing.cost import CostMeter, WorkerCost
from billing.host import HostCollector
from billing.nvml import NvmlCollector, TelemetryUnavailable
from billing.telemetry import BusyBasis, TelemetryCollector, WorkerBusy
from tests.billing.fake_host import FakeClock, FakeHost
from tests.billing.fake_nvml import GIB, FakeGpu, FakeNvml


def _meter(*workers: str, clock: FakeClock) -> CostMeter:
    return CostMeter(
        [WorkerCost(name, "smol", "v1", 3_600_000) for name in workers],
        windows_s=(60.0,),
        clock=clock,
    )


def _collector(
    pids: Mapping[str, int | None],
    script: Sequence[Sequence[FakeGpu]] | None,
    host: FakeHost,
    clock: FakeClock,
    *,
    meter: CostMeter | None = None,
    worker_gpus: Mapping[str, Sequence[int]] | None = None,
) -> TelemetryCollector:
    collector = TelemetryCollector(
        meter or _meter(*pids, clock=clock),
        lambda: pids,
        worker_gpus=worker_gpus,
        interval_s=10.0,
        host=host,
        nvml=None if script is None else (lambda: NvmlCollector(FakeNvml(script))),
        clock=clock,
    )
    collector.open()
    return collector


def _tick(
    collector: TelemetryCollector, clock: FakeClock, wall_s: float = 10.0
) -> dict[str, WorkerBusy]:
    clock.now += wall_s
    return {w.worker: w for w in collector.sample_once().workers}


def test_first_tick_only_takes_baselines() -> None:
    clock, host = FakeClock(), FakeHost()
    meter = _meter("a", clock=clock)
    collector = _collector({"a": None}, None, host, clock, meter=meter)
    assert collector.latest is not None
    assert collector.latest.workers == ()
    assert meter.snapshot()[0].worker_s == 0


def test_gpu_process_utilization_of_the_worker_process_tree() -> None:
    # Worker a (pid 100) runs its engine in child 101 on GPU 0 and a second rank, 102, on
    # GPU 1; worker b (200) shares GPU 1. Per-process figures: a's own SM share counts, not
    # b's, and not the device's 100%.
    script = [
        [FakeGpu(util_gpu=0, processes={101: GIB}), FakeGpu(util_gpu=0, processes={102: GIB})],
        [
            FakeGpu(util_gpu=90, processes={101: GIB}, process_util={101: 80}),
            FakeGpu(util_gpu=100, processes={102: GIB, 200: GIB}, process_util={102: 30, 200: 70}),
        ],
    ]
    clock, host = FakeClock(), FakeHost()
    host.set_process(100, children=[101, 102])
    host.set_process(200)
    collector = _collector({"a": 100, "b": 200}, script, host, clock)
    workers = _tick(collector, clock)
    # a: mean over its GPUs of its SM share = (80 + 30) / 2 = 55% of 10 s.
    assert workers["a"] == WorkerBusy("a", 5.5, 10.0, BusyBasis.GPU_PROCESS)
    assert workers["b"] == WorkerBusy("b", 7.0, 10.0, BusyBasis.GPU_PROCESS)
    assert collector.latest is not None
    assert dict(collector.latest.process_workers) == {101: "a", 102: "a", 200: "b"}


def test_several_processes_on_one_gpu_cap_at_fully_busy() -> None:
    on_gpu0, on_gpu1 = {1: GIB, 2: GIB}, {3: GIB}
    script = [
        [FakeGpu(processes=on_gpu0), FakeGpu(processes=on_gpu1)],
        [
            FakeGpu(processes=on_gpu0, process_util={1: 70, 2: 60}),
            FakeGpu(processes=on_gpu1, process_util={3: 10}),
        ],
    ]
    clock, host = FakeClock(), FakeHost()
    host.set_process(1, children=[2, 3])
    collector = _collector({"a": 1}, script, host, clock)
    # GPU 0 counts 100 %, not 130 %: (100 + 10) / 2 = 55 % of 10 s.
    assert _tick(collector, clock)["a"] == WorkerBusy("a", 5.5, 10.0, BusyBasis.GPU_PROCESS)


def test_device_utilization_without_per_process_figures() -> None:
    script = [
        [FakeGpu(processes={7: GIB}, process_util=None)],
        [FakeGpu(util_gpu=35, processes={7: GIB}, process_util=None)],
    ]
    clock, host = FakeClock(), FakeHost()
    host.set_process(7)
    collector = _collector({"a": 7}, script, host, clock)
    assert _tick(collector, clock)["a"] == WorkerBusy("a", 3.5, 10.0, BusyBasis.GPU_DEVICE)


def test_configured_gpus_for_a_worker_without_a_known_pid() -> None:
    script = [
        [FakeGpu(), FakeGpu(), FakeGpu()],
        [FakeGpu(util_gpu=20), FakeGpu(util_gpu=60), FakeGpu(util_gpu=100)],
    ]
    clock, host = FakeClock(), FakeHost()
    collector = _collector(
        {"ext": None, "gone": None}, script, host, clock, worker_gpus={"ext": [0, 1], "gone": [7]}
    )
    workers = _tick(collector, clock)
    assert workers["ext"] == WorkerBusy("ext", 4.0, 10.0, BusyBasis.GPU_DEVICE)  # (20+60)/2 %
    # GPU 7 does not exist: nothing known.
    assert workers["gone"] == WorkerBusy("gone", 10.0, 10.0, BusyBasis.ASSUMED_BUSY)


def test_host_cpu_without_a_gpu() -> None:
    clock, host = FakeClock(), FakeHost()
    host.set_process(300, 50.0, children=[301], num_cpus=4)
    collector = _collector({"cpu": 300}, None, host, clock)
    host.add_cpu(300, 10.0)  # 10 CPU-s of the 4 CPUs x 10 s it may use: a quarter
    assert _tick(collector, clock)["cpu"] == WorkerBusy("cpu", 2.5, 10.0, BusyBasis.HOST_CPU)
    host.add_cpu(300, 55.0)  # more than 4 CPUs can give in 10 s (sampling skew): capped
    assert _tick(collector, clock)["cpu"] == WorkerBusy("cpu", 10.0, 10.0, BusyBasis.HOST_CPU)
    host.add_cpu(300, -3.0)  # an unreaped child exited with its seconds: not negative
    assert _tick(collector, clock)["cpu"] == WorkerBusy("cpu", 0.0, 10.0, BusyBasis.HOST_CPU)


def test_host_cpu_for_a_cpu_worker_on_a_gpu_machine() -> None:
    script = [[FakeGpu(processes={9: GIB}, process_util={9: 100})]]
    clock, host = FakeClock(), FakeHost()
    host.set_process(300, num_cpus=2)
    collector = _collector({"cpu": 300}, script, host, clock)
    host.add_cpu(300, 5.0)
    assert _tick(collector, clock)["cpu"] == WorkerBusy("cpu", 2.5, 10.0, BusyBasis.HOST_CPU)


def test_assumed_busy_when_nothing_is_known() -> None:
    clock, host = FakeClock(), FakeHost()
    host.set_process(400, 5.0, create_time=1000.0)
    host.set_process(500, 5.0)
    collector = _collector({"external": None, "restarted": 400, "gone": 500}, None, host, clock)
    host.set_process(400, 1.0, create_time=2000.0)  # same pid, new process: no baseline
    del host.processes[500]
    workers = _tick(collector, clock, wall_s=7.0)
    for name in ("external", "restarted", "gone"):
        assert workers[name] == WorkerBusy(name, 7.0, 7.0, BusyBasis.ASSUMED_BUSY)
    host.add_cpu(400, 3.5)  # the restarted process has a baseline now
    assert _tick(collector, clock)["restarted"].basis is BusyBasis.HOST_CPU


def test_busy_time_reaches_the_meter_for_priced_workers_only() -> None:
    clock, host = FakeClock(), FakeHost()
    meter = _meter("priced", clock=clock)
    host.set_process(1, num_cpus=1)
    collector = _collector({"priced": 1, "unpriced": None}, None, host, clock, meter=meter)
    host.add_cpu(1, 4.0)
    workers = _tick(collector, clock)
    assert set(workers) == {"priced", "unpriced"}  # both reported for metrics
    (figure,) = meter.snapshot()
    assert (figure.busy_s, figure.worker_s) == (4.0, 10.0)


def test_no_gpu_falls_back_to_the_host_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    def no_driver() -> NvmlCollector:
        return NvmlCollector.open(FakeNvml([[]], init_error="NVML Shared Library Not Found"))

    clock, host = FakeClock(), FakeHost()
    host.set_process(1, num_cpus=1)
    collector = TelemetryCollector(
        _meter("a", clock=clock), lambda: {"a": 1}, host=host, nvml=no_driver, clock=clock
    )
    with caplog.at_level(logging.INFO, logger="tandem.billing"):
        collector.open()
        collector.open()  # a second open does not try (or log) again
        host.add_cpu(1, 1.0)
        workers = _tick(collector, clock)
    assert not collector.has_gpu
    assert workers["a"].basis is BusyBasis.HOST_CPU
    notes = [r for r in caplog.records if "no GPU telemetry" in r.getMessage()]
    assert len(notes) == 1
    assert notes[0].levelno == logging.INFO


def test_a_failing_gpu_tick_falls_back_then_recovers(caplog: pytest.LogCaptureFixture) -> None:
    ok = [FakeGpu(util_gpu=50, processes={1: GIB}, process_util=None)]
    script = [ok, [FakeGpu(lost=True)], [FakeGpu(lost=True)], ok]
    clock, host = FakeClock(), FakeHost()
    host.set_process(1, num_cpus=1)
    collector = _collector({"a": 1}, script, host, clock)
    with caplog.at_level(logging.INFO, logger="tandem.billing"):
        host.add_cpu(1, 2.0)
        assert _tick(collector, clock)["a"] == WorkerBusy("a", 2.0, 10.0, BusyBasis.HOST_CPU)
        assert _tick(collector, clock)["a"].basis is BusyBasis.HOST_CPU
        assert _tick(collector, clock)["a"] == WorkerBusy("a", 5.0, 10.0, BusyBasis.GPU_DEVICE)
    messages = [r.getMessage() for r in caplog.records]
    assert sum("GPU telemetry failed" in m for m in messages) == 1
    assert sum("GPU telemetry is back" in m for m in messages) == 1
    assert collector.latest is not None
    assert len(collector.latest.gpus) == 1


async def test_start_runs_the_loop_and_aclose_releases_the_gpu() -> None:
    fake = FakeNvml([[FakeGpu(util_gpu=40, processes={1: GIB}, process_util=None)]])
    seconds = itertools.count()  # each reading is one second later
    meter = CostMeter([WorkerCost("a", "smol", "v1", 3_600_000)], clock=lambda: 0.0)
    collector = TelemetryCollector(
        meter,
        lambda: {"a": 1},
        interval_s=0.001,
        host=FakeHost(),
        nvml=lambda: NvmlCollector.open(fake),
        clock=lambda: float(next(seconds)),
    )
    await collector.start()
    try:
        assert fake.initialised
        for _ in range(2000):  # bounded: the loop ticks every millisecond
            latest = collector.latest
            if latest is not None and latest.workers:
                break
            await asyncio.sleep(0.005)
        assert latest is not None
        assert latest.workers == (WorkerBusy("a", 0.4, 1.0, BusyBasis.GPU_DEVICE),)
    finally:
        await collector.aclose()
    assert fake.shut_down
    await collector.aclose()  # idempotent


# --- the real psutil collector --------------------------------------------------------------

_BURN = """
import sys, time
while time.process_time() < 0.25:
    pass
print("done", flush=True)
sys.stdin.read()
"""


def test_host_collector_reads_a_real_process_tree() -> None:
    host = HostCollector()
    sample = host.sample()
    assert sample.num_cpus >= 1
    assert 0 < sample.memory_used_bytes <= sample.memory_total_bytes
    assert 0.0 <= sample.cpu_pct <= 100.0
    child = subprocess.Popen(
        [sys.executable, "-c", _BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        # It has used 0.25 s of CPU by now; /proc counts in 10 ms ticks, so ask for 0.2.
        assert child.stdout.readline() == "done\n"
        burned = host.process_cpu(child.pid)
        assert burned is not None
        assert burned.cpu_s >= 0.2
        assert burned.pids == {child.pid}
        assert burned.num_cpus >= 1
        mine = host.process_cpu(psutil.Process().pid)
        assert mine is not None
        assert child.pid in mine.pids
        assert mine.cpu_s >= burned.cpu_s  # a live child's seconds count in its parent's tree
    finally:
        child.communicate("")
    assert host.process_cpu(child.pid) is None  # gone (and reaped)


def test_telemetry_over_nvml_failure_is_not_fatal_at_open() -> None:
    def broken() -> NvmlCollector:
        raise TelemetryUnavailable("Driver Not Loaded")

    clock = FakeClock()
    collector = TelemetryCollector(
        _meter("a", clock=clock), dict, host=FakeHost(), nvml=broken, clock=clock
    )
    assert collector.open().gpus == ()
    assert not collector.has_gpu
