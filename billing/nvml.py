"""GPU telemetry through NVML: what each GPU and each process on it is doing right now.

Three pieces, so the cost meter can be tested without a GPU:

- ``NvmlLibrary``: the few NVML calls the meter needs, by device index. Calls a GPU may not
  support (power, process lists, per-process utilization) answer ``None`` instead of raising;
  anything else that goes wrong raises ``TelemetryUnavailable``.
- ``PynvmlLibrary``: that protocol over the real ``pynvml`` module (package ``nvidia-ml-py``),
  imported only when ``init()`` runs, so a machine without it (or without a GPU) only loses GPU
  telemetry.
- ``NvmlCollector``: one ``sample()`` reads every GPU into frozen ``GpuSample``s.

Process ids are the ones NVML reports, which are the host's: a gateway in its own PID namespace
(a container) will not find its workers among them, and must say which GPUs a worker owns.
"""

from __future__ import annotations

import importlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Protocol


class TelemetryUnavailable(Exception):
    """NVML cannot be loaded or answered with an error that is not "not supported here"."""


@dataclass(frozen=True, slots=True)
class Utilization:
    """A GPU's utilization over NVML's last sample period (1/6 s to 1 s, per product)."""

    gpu_pct: int
    """Percent of the period during which one or more kernels ran."""
    memory_pct: int
    """Percent of the period during which device memory was read or written."""


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """A GPU's device memory."""

    used_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """A compute process on a GPU."""

    pid: int
    used_memory_bytes: int | None
    """``None`` where the driver cannot tell (Windows WDDM)."""


@dataclass(frozen=True, slots=True)
class ProcessUtilization:
    """One per-process utilization sample (``nvmlDeviceGetProcessUtilization``)."""

    pid: int
    sm_pct: int
    """Percent of the sample period during which the process's kernels ran on the SMs."""
    timestamp_us: int
    """When the sample was taken: CPU time in microseconds, NVML's clock."""


class NvmlLibrary(Protocol):
    """The subset of NVML the cost meter reads. Devices are named by index (0..count-1).

    Every method raises ``TelemetryUnavailable`` on a real failure (driver gone, GPU lost).
    """

    def init(self) -> None:
        """Load and initialise NVML; ``TelemetryUnavailable`` where there is none."""
        ...

    def shutdown(self) -> None:
        """Release NVML."""
        ...

    def device_count(self) -> int:
        """How many GPUs this process can see."""
        ...

    def name(self, index: int) -> str:
        """The product name, e.g. ``NVIDIA H100 80GB HBM3``."""
        ...

    def uuid(self, index: int) -> str:
        """The GPU's stable identity (``GPU-...``), unlike its index."""
        ...

    def utilization(self, index: int) -> Utilization | None:
        """Device utilization; ``None`` where not supported (e.g. a MIG instance)."""
        ...

    def memory(self, index: int) -> MemoryInfo:
        """Device memory in use and in total."""
        ...

    def power_mw(self, index: int) -> int | None:
        """Power draw in milliwatts; ``None`` where not supported."""
        ...

    def compute_processes(self, index: int) -> list[ProcessMemory] | None:
        """The compute processes on the GPU; ``None`` where not supported."""
        ...

    def process_utilization(self, index: int, since_us: int) -> list[ProcessUtilization] | None:
        """Per-process samples taken after ``since_us`` (NVML's clock; 0 = whatever is still
        buffered). ``None`` where not supported; ``[]`` when no process used the GPU since."""
        ...


@dataclass(frozen=True, slots=True)
class GpuProcessSample:
    """A compute process on one GPU, as of one sample."""

    pid: int
    used_memory_bytes: int | None
    sm_util_pct: int | None
    """The process's SM utilization since the previous sample (0 when NVML sampled it idle);
    ``None`` when the GPU gives no per-process figures."""


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One GPU, as of one sample."""

    index: int
    uuid: str
    name: str
    utilization_gpu_pct: int | None
    """``None`` where the GPU does not report it."""
    utilization_mem_pct: int | None
    memory_used_bytes: int
    memory_total_bytes: int
    power_w: float | None
    """``None`` where the GPU does not report it."""
    processes: tuple[GpuProcessSample, ...]
    """Empty where the GPU does not list its processes."""


class NvmlCollector:
    """Reads every GPU through an initialised ``NvmlLibrary``. One caller at a time (the
    telemetry loop's thread): it remembers the last per-process sample it saw per GPU."""

    def __init__(self, library: NvmlLibrary) -> None:
        self._library = library
        self._identity: dict[int, tuple[str, str]] = {}
        self._last_seen_us: dict[int, int] = {}

    @classmethod
    def open(cls, library: NvmlLibrary | None = None) -> NvmlCollector:
        """Initialise ``library`` (default: the real NVML) and wrap it; raises
        ``TelemetryUnavailable`` on a machine without a usable GPU driver."""
        library = PynvmlLibrary() if library is None else library
        library.init()
        return cls(library)

    def close(self) -> None:
        """Release the library."""
        self._library.shutdown()

    def sample(self) -> list[GpuSample]:
        """Every GPU's state now; raises ``TelemetryUnavailable`` if NVML fails."""
        lib = self._library
        samples: list[GpuSample] = []
        # Counted every time: a GPU that fell off the bus must not be read as idle.
        for index in range(lib.device_count()):
            if index not in self._identity:
                self._identity[index] = (lib.uuid(index), lib.name(index))
            uuid, name = self._identity[index]
            utilization = lib.utilization(index)
            memory = lib.memory(index)
            power_mw = lib.power_mw(index)
            samples.append(
                GpuSample(
                    index=index,
                    uuid=uuid,
                    name=name,
                    utilization_gpu_pct=None if utilization is None else utilization.gpu_pct,
                    utilization_mem_pct=None if utilization is None else utilization.memory_pct,
                    memory_used_bytes=memory.used_bytes,
                    memory_total_bytes=memory.total_bytes,
                    power_w=None if power_mw is None else power_mw / 1000,
                    processes=self._processes(index),
                )
            )
        return samples

    def _processes(self, index: int) -> tuple[GpuProcessSample, ...]:
        lib = self._library
        processes = lib.compute_processes(index)
        if processes is None:
            return ()
        since_us = self._last_seen_us.get(index, 0)
        util = lib.process_utilization(index, since_us)
        sm_pct: dict[int, int] | None = None
        if util is not None:
            # Asking from the newest sample already seen, not from our own clock: NVML's
            # timestamps are its own, and this way no sample is counted twice or skipped.
            self._last_seen_us[index] = max((s.timestamp_us for s in util), default=since_us)
            # NVML keeps one sample per process and period; several may have piled up since.
            per_pid: defaultdict[int, list[int]] = defaultdict(list)
            for s in util:
                per_pid[s.pid].append(s.sm_pct)
            sm_pct = {pid: round(sum(v) / len(v)) for pid, v in per_pid.items()}
        return tuple(
            GpuProcessSample(
                pid=p.pid,
                used_memory_bytes=p.used_memory_bytes,
                # A listed process without a sample did not run a kernel since: idle.
                sm_util_pct=None if sm_pct is None else sm_pct.get(p.pid, 0),
            )
            for p in processes
        )


class PynvmlLibrary:
    """``NvmlLibrary`` over the real ``pynvml`` module (package ``nvidia-ml-py``)."""

    def __init__(self, module: Any = None) -> None:
        """``module``: a stand-in for ``pynvml`` (tests); by default it is imported by
        ``init()``."""
        # Any: pynvml ships no type information; every value read from it is converted here.
        self._nvml: Any = module
        self._handles: dict[int, Any] = {}

    def init(self) -> None:
        """Import ``pynvml`` and initialise NVML."""
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise TelemetryUnavailable(f"pynvml is not installed: {exc}") from exc
        self._call("nvmlInit")

    def shutdown(self) -> None:
        """Shut NVML down; its handles are invalid afterwards."""
        self._handles.clear()
        self._call("nvmlShutdown")

    def device_count(self) -> int:
        """How many GPUs this process can see."""
        return int(self._call("nvmlDeviceGetCount"))

    def name(self, index: int) -> str:
        """The product name."""
        return _text(self._call("nvmlDeviceGetName", self._handle(index)))

    def uuid(self, index: int) -> str:
        """The GPU's UUID."""
        return _text(self._call("nvmlDeviceGetUUID", self._handle(index)))

    def utilization(self, index: int) -> Utilization | None:
        """Device utilization, or ``None`` where not supported."""
        rates = self._optional("nvmlDeviceGetUtilizationRates", self._handle(index))
        return None if rates is None else Utilization(int(rates.gpu), int(rates.memory))

    def memory(self, index: int) -> MemoryInfo:
        """Device memory."""
        info = self._call("nvmlDeviceGetMemoryInfo", self._handle(index))
        return MemoryInfo(used_bytes=int(info.used), total_bytes=int(info.total))

    def power_mw(self, index: int) -> int | None:
        """Power draw in milliwatts, or ``None`` where not supported."""
        power = self._optional("nvmlDeviceGetPowerUsage", self._handle(index))
        return None if power is None else int(power)

    def compute_processes(self, index: int) -> list[ProcessMemory] | None:
        """Compute processes, or ``None`` where not supported."""
        processes = self._optional("nvmlDeviceGetComputeRunningProcesses", self._handle(index))
        if processes is None:
            return None
        return [
            ProcessMemory(
                pid=int(p.pid),
                used_memory_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
            )
            for p in processes
        ]

    def process_utilization(self, index: int, since_us: int) -> list[ProcessUtilization] | None:
        """Per-process samples since ``since_us``; ``None`` where not supported."""
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(self._handle(index), since_us)
        except nvml.NVMLError as exc:
            # This call's NOT_FOUND means "no sample since since_us" (nvml.h): every process
            # was idle, which is a figure, not an absence.
            if exc.value == nvml.NVML_ERROR_NOT_FOUND:
                return []
            if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED:
                return None
            raise TelemetryUnavailable(f"nvmlDeviceGetProcessUtilization: {exc}") from exc
        return [
            ProcessUtilization(pid=int(s.pid), sm_pct=int(s.smUtil), timestamp_us=int(s.timeStamp))
            for s in samples
        ]

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._call("nvmlDeviceGetHandleByIndex", index)
        return self._handles[index]

    def _call(self, function: str, *args: Any) -> Any:
        nvml = self._nvml
        if nvml is None:
            raise TelemetryUnavailable("NVML is not initialised")
        try:
            return getattr(nvml, function)(*args)
        except nvml.NVMLError as exc:
            raise TelemetryUnavailable(f"{function}: {exc}") from exc

    def _optional(self, function: str, *args: Any) -> Any:
        """``_call``, with "not supported"/"not found" answered as ``None``."""
        nvml = self._nvml
        try:
            return self._call(function, *args)
        except TelemetryUnavailable as exc:
            cause = exc.__cause__
            absent = (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_NOT_FOUND)
            if isinstance(cause, nvml.NVMLError) and cause.value in absent:
                return None
            raise


def _text(value: Any) -> str:
    # Older nvidia-ml-py releases return bytes for names and UUIDs.
    return value.decode() if isinstance(value, bytes) else str(value)
