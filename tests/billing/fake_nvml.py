"""A fake NVML library (``billing.nvml.NvmlLibrary``), scripted per tick.

The script is a list of ticks, each the list of GPUs as they are at that tick. A tick starts
with ``device_count()`` (``NvmlCollector.sample`` asks it first, once per sample); the last
tick repeats. ``None`` in a field means NVML answers "not supported" for that call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from billing.nvml import (
    MemoryInfo,
    ProcessMemory,
    ProcessUtilization,
    TelemetryUnavailable,
    Utilization,
)

GIB = 2**30


@dataclass
class FakeGpu:
    """One GPU at one tick."""

    util_gpu: int | None = 0
    """Device utilization %; None: not supported."""
    util_mem: int = 0
    memory_used: int = 0
    memory_total: int = 80 * GIB
    power_mw: int | None = 300_000
    processes: dict[int, int | None] | None = field(default_factory=dict)
    """pid -> used memory bytes; None: the GPU does not list processes."""
    process_util: dict[int, int] | None = field(default_factory=dict)
    """pid -> SM % for the processes NVML sampled busy; None: no per-process figures."""
    lost: bool = False
    """Every call about this GPU fails (it fell off the bus)."""


@dataclass
class FakeNvml:
    """``NvmlLibrary`` playing ``script``; records what it was asked."""

    script: Sequence[Sequence[FakeGpu]]
    init_error: str | None = None
    """``init()`` raises ``TelemetryUnavailable`` with this message (no driver)."""
    tick: int = -1
    initialised: bool = False
    shut_down: bool = False
    since_calls: list[tuple[int, int]] = field(default_factory=list)
    """(gpu index, since_us) of every ``process_utilization`` call."""

    def init(self) -> None:
        if self.init_error is not None:
            raise TelemetryUnavailable(self.init_error)
        self.initialised = True

    def shutdown(self) -> None:
        self.shut_down = True

    def device_count(self) -> int:
        self.tick += 1
        return len(self._gpus())

    def name(self, index: int) -> str:
        self._gpu(index)
        return "Fake H100"

    def uuid(self, index: int) -> str:
        self._gpu(index)
        return f"GPU-fake-{index}"

    def utilization(self, index: int) -> Utilization | None:
        gpu = self._gpu(index)
        return None if gpu.util_gpu is None else Utilization(gpu.util_gpu, gpu.util_mem)

    def memory(self, index: int) -> MemoryInfo:
        gpu = self._gpu(index)
        return MemoryInfo(used_bytes=gpu.memory_used, total_bytes=gpu.memory_total)

    def power_mw(self, index: int) -> int | None:
        return self._gpu(index).power_mw

    def compute_processes(self, index: int) -> list[ProcessMemory] | None:
        gpu = self._gpu(index)
        if gpu.processes is None:
            return None
        return [ProcessMemory(pid, used) for pid, used in gpu.processes.items()]

    def process_utilization(self, index: int, since_us: int) -> list[ProcessUtilization] | None:
        gpu = self._gpu(index)
        self.since_calls.append((index, since_us))
        if gpu.process_util is None:
            return None
        # One sample per busy process, stamped with the tick: a second ask within the same
        # tick (since_us = that stamp) gets nothing, as with NVML.
        stamp = (self._tick() + 1) * 1_000_000
        if stamp <= since_us:
            return []
        return [ProcessUtilization(pid, pct, stamp) for pid, pct in gpu.process_util.items()]

    def _tick(self) -> int:
        return min(max(self.tick, 0), len(self.script) - 1)

    def _gpus(self) -> Sequence[FakeGpu]:
        return self.script[self._tick()]

    def _gpu(self, index: int) -> FakeGpu:
        gpus = self._gpus()
        if not 0 <= index < len(gpus):
            raise TelemetryUnavailable(f"no GPU {index}")
        if gpus[index].lost:
            raise TelemetryUnavailable(f"GPU {index} is lost")
        return gpus[index]
