"""GPU telemetry: ``NvmlCollector`` over the fake NVML, and the ``pynvml`` adapter's error
mapping over a stand-in module raising the real ``pynvml.NVMLError``s (no GPU needed)."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from billing.nvml import (
    GpuProcessSample,
    NvmlCollector,
    ProcessMemory,
    ProcessUtilization,
    PynvmlLibrary,
    TelemetryUnavailable,
    Utilization,
)
from tests.billing.fake_nvml import GIB, FakeGpu, FakeNvml

# --- NvmlCollector -------------------------------------------------------------------------


def test_sample_reads_every_gpu() -> None:
    gpu = FakeGpu(
        util_gpu=87,
        util_mem=40,
        memory_used=30 * GIB,
        power_mw=412_500,
        processes={101: 20 * GIB, 102: None},
        process_util={101: 70},
    )
    collector = NvmlCollector(FakeNvml([[gpu, FakeGpu()]]))
    first, second = collector.sample()
    assert (first.index, first.uuid, first.name) == (0, "GPU-fake-0", "Fake H100")
    assert (first.utilization_gpu_pct, first.utilization_mem_pct) == (87, 40)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (30 * GIB, 80 * GIB)
    assert first.power_w == 412.5
    # 102 has no sample: NVML only reports processes that ran a kernel, so it was idle.
    assert first.processes == (
        GpuProcessSample(pid=101, used_memory_bytes=20 * GIB, sm_util_pct=70),
        GpuProcessSample(pid=102, used_memory_bytes=None, sm_util_pct=0),
    )
    assert second.index == 1
    assert second.processes == ()


def test_unsupported_calls_are_absent_not_fatal() -> None:
    gpu = FakeGpu(util_gpu=None, power_mw=None, processes={7: GIB}, process_util=None)
    no_list = FakeGpu(processes=None)
    (sample, listless) = NvmlCollector(FakeNvml([[gpu, no_list]])).sample()
    assert sample.utilization_gpu_pct is None
    assert sample.utilization_mem_pct is None
    assert sample.power_w is None
    assert sample.processes == (GpuProcessSample(pid=7, used_memory_bytes=GIB, sm_util_pct=None),)
    assert listless.processes == ()


def test_process_utilization_asked_from_the_last_sample_seen() -> None:
    busy = FakeGpu(processes={5: GIB}, process_util={5: 30})
    idle = FakeGpu(processes={5: GIB}, process_util={})
    fake = FakeNvml([[busy], [idle], [busy]])
    collector = NvmlCollector(fake)
    sm = [collector.sample()[0].processes[0].sm_util_pct for _ in range(3)]
    assert sm == [30, 0, 30]
    # First ask: whatever NVML still buffers (0); then from the newest stamp seen (tick 1's).
    # An idle tick returns no sample, so the next ask starts from the same stamp.
    assert fake.since_calls == [(0, 0), (0, 1_000_000), (0, 1_000_000)]


def test_a_lost_gpu_fails_the_sample() -> None:
    collector = NvmlCollector(FakeNvml([[FakeGpu(lost=True)]]))
    with pytest.raises(TelemetryUnavailable, match="lost"):
        collector.sample()


def test_open_and_close_the_library() -> None:
    fake = FakeNvml([[FakeGpu()]])
    collector = NvmlCollector.open(fake)
    assert fake.initialised
    collector.close()
    assert fake.shut_down
    with pytest.raises(TelemetryUnavailable, match="no driver"):
        NvmlCollector.open(FakeNvml([[]], init_error="no driver"))


# --- PynvmlLibrary over a stand-in module ----------------------------------------------------


def _raise(code: int) -> Any:
    def call(*_: object) -> Any:
        raise pynvml.NVMLError(code)  # the real class: maps the code to its subclass

    return call


def _module(**overrides: Any) -> SimpleNamespace:
    module = SimpleNamespace(
        NVMLError=pynvml.NVMLError,
        NVML_ERROR_NOT_SUPPORTED=pynvml.NVML_ERROR_NOT_SUPPORTED,
        NVML_ERROR_NOT_FOUND=pynvml.NVML_ERROR_NOT_FOUND,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 1,
        nvmlDeviceGetHandleByIndex=lambda index: ("handle", index),
        nvmlDeviceGetName=lambda handle: b"NVIDIA H200",  # older releases answer bytes
        nvmlDeviceGetUUID=lambda handle: "GPU-1234",
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(total=100, free=60, used=40),
        nvmlDeviceGetPowerUsage=lambda handle: 412_345,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [
            SimpleNamespace(pid=10, usedGpuMemory=1024),
            SimpleNamespace(pid=11, usedGpuMemory=None),
        ],
        nvmlDeviceGetProcessUtilization=lambda handle, since: [
            SimpleNamespace(pid=10, timeStamp=since + 5, smUtil=70, memUtil=3)
        ],
    )
    vars(module).update(overrides)
    return module


def _library(**overrides: Any) -> PynvmlLibrary:
    library = PynvmlLibrary(_module(**overrides))
    library.init()
    return library


def test_adapter_converts_answers() -> None:
    library = _library()
    assert library.device_count() == 1
    assert library.name(0) == "NVIDIA H200"
    assert library.uuid(0) == "GPU-1234"
    assert library.utilization(0) == Utilization(gpu_pct=87, memory_pct=40)
    assert (library.memory(0).used_bytes, library.memory(0).total_bytes) == (40, 100)
    assert library.power_mw(0) == 412_345
    assert library.compute_processes(0) == [ProcessMemory(10, 1024), ProcessMemory(11, None)]
    assert library.process_utilization(0, 100) == [ProcessUtilization(10, 70, 105)]


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_NOT_FOUND])
def test_adapter_reads_not_supported_as_absent(code: int) -> None:
    library = _library(
        nvmlDeviceGetPowerUsage=_raise(code),
        nvmlDeviceGetUtilizationRates=_raise(code),
        nvmlDeviceGetComputeRunningProcesses=_raise(code),
    )
    assert library.power_mw(0) is None
    assert library.utilization(0) is None
    assert library.compute_processes(0) is None


def test_adapter_process_utilization_not_found_means_idle() -> None:
    # nvml.h: NOT_FOUND = no sample since the timestamp, i.e. no process ran a kernel.
    idle = _library(nvmlDeviceGetProcessUtilization=_raise(pynvml.NVML_ERROR_NOT_FOUND))
    assert idle.process_utilization(0, 0) == []
    unsupported = _library(nvmlDeviceGetProcessUtilization=_raise(pynvml.NVML_ERROR_NOT_SUPPORTED))
    assert unsupported.process_utilization(0, 0) is None


@pytest.mark.parametrize(
    ("function", "call"),
    [
        ("nvmlDeviceGetPowerUsage", lambda lib: lib.power_mw(0)),
        ("nvmlDeviceGetMemoryInfo", lambda lib: lib.memory(0)),
        ("nvmlDeviceGetCount", lambda lib: lib.device_count()),
        ("nvmlDeviceGetProcessUtilization", lambda lib: lib.process_utilization(0, 0)),
        ("nvmlDeviceGetHandleByIndex", lambda lib: lib.name(0)),
    ],
)
def test_adapter_maps_real_failures_to_one_exception(function: str, call: Any) -> None:
    library = _library(**{function: _raise(pynvml.NVML_ERROR_GPU_IS_LOST)})
    with pytest.raises(TelemetryUnavailable, match="GPU is lost") as caught:
        call(library)
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)


def test_adapter_init_failures() -> None:
    no_driver = PynvmlLibrary(_module(nvmlInit=_raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)))
    with pytest.raises(TelemetryUnavailable, match="Library Not Found"):
        no_driver.init()
    # Even "not supported" is fatal where the answer is required.
    with pytest.raises(TelemetryUnavailable):
        _library(nvmlDeviceGetMemoryInfo=_raise(pynvml.NVML_ERROR_NOT_SUPPORTED)).memory(0)


def test_adapter_without_pynvml_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(TelemetryUnavailable, match="not installed"):
        PynvmlLibrary().init()


def test_adapter_used_before_init() -> None:
    with pytest.raises(TelemetryUnavailable, match="not initialised"):
        PynvmlLibrary().device_count()


def test_real_nvml_opens_or_says_unavailable() -> None:
    # This machine may or may not have a GPU: either answer is fine, a raw NVMLError is not.
    try:
        collector = NvmlCollector.open()
    except TelemetryUnavailable:
        return
    try:
        for sample in collector.sample():
            assert sample.memory_total_bytes > 0
    finally:
        collector.close()


def test_collector_over_the_adapter() -> None:
    (sample,) = NvmlCollector(_library()).sample()
    assert sample.name == "NVIDIA H200"
    assert sample.power_w == 412.345
    assert sample.processes == (
        GpuProcessSample(10, 1024, 70),
        GpuProcessSample(11, None, 0),
    )
