"""The telemetry loop: every few seconds, how busy each worker was, fed to the cost meter.

Each tick reads the GPUs (NVML, when the machine has one) and the host (psutil) in a thread,
then, on the event loop, turns the readings into busy seconds per worker over the tick's wall
interval, on the first basis that applies:

1. ``gpu_process``: the worker's processes (its pid and descendants: vLLM's engine core is a
   child) are on GPUs that report per-process SM utilization: their summed utilization per GPU
   (at most 100%), averaged over those GPUs.
2. ``gpu_device``: the worker's GPUs (found through its processes, else from ``worker_gpus``)
   only report device utilization: that, averaged. Another tenant of the GPU counts as the
   worker's, which errs towards cost.
3. ``host_cpu``: the worker's process tree's CPU seconds during the interval, over what the
   CPUs it may use could have given (``wall x len(cpu_affinity)``).
4. ``assumed_busy``: nothing is known (external worker, process gone, first tick of a new pid):
   fully busy, so its busy cost is its provisioned cost rather than a flattering zero.

Busy seconds never exceed the wall interval. The first tick only takes baselines.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from billing.cost import CostMeter
from billing.host import HostCollector, HostSample, HostTelemetry, ProcessCpu
from billing.nvml import GpuProcessSample, GpuSample, NvmlCollector, TelemetryUnavailable

log = logging.getLogger("tandem.billing")


class BusyBasis(enum.StrEnum):
    """How a worker's busy time was measured (the module docstring orders them)."""

    GPU_PROCESS = "gpu_process"
    GPU_DEVICE = "gpu_device"
    HOST_CPU = "host_cpu"
    ASSUMED_BUSY = "assumed_busy"


@dataclass(frozen=True, slots=True)
class WorkerBusy:
    """One worker over one tick."""

    worker: str
    busy_s: float
    wall_s: float
    basis: BusyBasis

    @property
    def ratio(self) -> float:
        """Busy fraction of the tick, 0..1."""
        return self.busy_s / self.wall_s


@dataclass(frozen=True, slots=True)
class TelemetrySnapshot:
    """The latest tick: raw samples and what was made of them."""

    at: float
    """The collector's clock when the samples were taken."""
    gpus: tuple[GpuSample, ...]
    """Empty without GPU telemetry (no GPU, or NVML failed this tick)."""
    host: HostSample
    workers: tuple[WorkerBusy, ...]
    """Empty on the first tick (baselines only)."""
    process_workers: Mapping[int, str]
    """GPU process pid -> the worker whose process tree it belongs to."""


@dataclass(frozen=True, slots=True)
class _Readings:
    at: float
    pids: Mapping[str, int | None]
    gpus: list[GpuSample] | None
    gpu_error: str | None
    host: HostSample
    processes: Mapping[int, ProcessCpu | None]


class TelemetryCollector:
    """Samples GPUs and host every ``interval_s`` and reports each worker's busy seconds to the
    ``CostMeter``; ``start()``/``aclose()`` own the loop."""

    def __init__(
        self,
        meter: CostMeter,
        worker_pids: Callable[[], Mapping[str, int | None]],
        *,
        worker_gpus: Mapping[str, Sequence[int]] | None = None,
        interval_s: float = 5.0,
        host: HostTelemetry | None = None,
        nvml: Callable[[], NvmlCollector] | None = NvmlCollector.open,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``worker_pids``: worker name -> pid of its process (None: external or unknown), read
        on the event loop every tick. ``worker_gpus``: GPU indexes a worker owns, for workers
        whose processes cannot be found on the GPUs. ``host``: default psutil. ``nvml``: opens
        the GPU library at start (``TelemetryUnavailable``: host only); None: host only.
        ``clock``: the meter's clock."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._meter = meter
        self._worker_pids = worker_pids
        self._worker_gpus = {name: tuple(gpus) for name, gpus in (worker_gpus or {}).items()}
        self._interval_s = interval_s
        self._host = HostCollector() if host is None else host
        self._open_nvml = nvml
        self._clock = clock
        self._gpu: NvmlCollector | None = None
        self._gpu_tried = False
        self._gpu_failing = False
        self._prev_at: float | None = None
        self._cpu_base: dict[tuple[int, float], float] = {}
        self._latest: TelemetrySnapshot | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def latest(self) -> TelemetrySnapshot | None:
        """The latest tick, for metrics; None before the first."""
        return self._latest

    @property
    def has_gpu(self) -> bool:
        """Whether GPU telemetry was opened."""
        return self._gpu is not None

    def open(self) -> TelemetrySnapshot:
        """Open the GPU library (blocking) and take the baseline sample. ``start()`` does this
        itself; call it directly only to drive ``sample_once()`` by hand (tests)."""
        self._open_gpu()
        return self.sample_once()

    def sample_once(self) -> TelemetrySnapshot:
        """Take one tick now (blocking) and report it to the meter."""
        return self._account(self._read(dict(self._worker_pids())))

    def close(self) -> None:
        """Release the GPU library (blocking)."""
        gpu, self._gpu = self._gpu, None
        if gpu is not None:
            with contextlib.suppress(TelemetryUnavailable):  # nothing left to release
                gpu.close()

    async def start(self) -> None:
        """Open the GPU library, take the baseline, and start the loop."""
        await asyncio.to_thread(self._open_gpu)
        await self._tick()
        self._task = asyncio.create_task(self._loop(), name="tandem-telemetry")

    async def aclose(self) -> None:
        """Stop the loop and release the GPU library."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self.close)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self._tick()

    async def _tick(self) -> None:
        # Worker pids are read here, on the loop, where the pools change them; the meter is
        # fed here too, so only the blocking reads run in the thread.
        pids = dict(self._worker_pids())
        self._account(await asyncio.to_thread(self._read, pids))

    def _open_gpu(self) -> None:
        # Once: a machine without a GPU says so at start, not on every tick or reopen.
        if self._open_nvml is None or self._gpu_tried:
            return
        self._gpu_tried = True
        try:
            self._gpu = self._open_nvml()
        except TelemetryUnavailable as exc:
            log.info("no GPU telemetry (%s): worker busy time from the host only", exc)

    def _read(self, pids: Mapping[str, int | None]) -> _Readings:
        gpus: list[GpuSample] | None = None
        gpu_error: str | None = None
        if self._gpu is not None:
            try:
                gpus = self._gpu.sample()
            except TelemetryUnavailable as exc:
                gpu_error = str(exc)
        at = self._clock()
        processes = {pid: self._host.process_cpu(pid) for pid in pids.values() if pid is not None}
        return _Readings(at, pids, gpus, gpu_error, self._host.sample(), processes)

    def _account(self, r: _Readings) -> TelemetrySnapshot:
        if r.gpu_error is not None and not self._gpu_failing:
            log.warning("GPU telemetry failed (%s): host only until it answers", r.gpu_error)
        elif r.gpu_error is None and self._gpu_failing:
            log.info("GPU telemetry is back")
        self._gpu_failing = r.gpu_error is not None

        prev_at, self._prev_at = self._prev_at, r.at
        cpu_base = self._cpu_base
        self._cpu_base = {(p.pid, p.create_time): p.cpu_s for p in r.processes.values() if p}

        gpus = {gpu.index: gpu for gpu in r.gpus or ()}
        on_gpu: defaultdict[int, list[tuple[int, GpuProcessSample]]] = defaultdict(list)
        for gpu in gpus.values():
            for process in gpu.processes:
                on_gpu[process.pid].append((gpu.index, process))

        workers: list[WorkerBusy] = []
        process_workers: dict[int, str] = {}
        wall_s = 0.0 if prev_at is None else r.at - prev_at
        for name, pid in r.pids.items():
            tree = r.processes.get(pid) if pid is not None else None
            tree_pids = tree.pids if tree is not None else frozenset(() if pid is None else (pid,))
            found = [entry for p in sorted(tree_pids) for entry in on_gpu.get(p, ())]
            process_workers.update((process.pid, name) for _, process in found)
            if wall_s <= 0:
                continue
            busy_s, basis = self._busy(name, wall_s, gpus, found, tree, cpu_base)
            workers.append(WorkerBusy(name, busy_s, wall_s, basis))
            if self._meter.has_worker(name):
                self._meter.observe_busy(name, busy_s, wall_s, at=r.at)

        self._latest = TelemetrySnapshot(
            at=r.at,
            gpus=tuple(gpus.values()),
            host=r.host,
            workers=tuple(workers),
            process_workers=process_workers,
        )
        return self._latest

    def _busy(
        self,
        name: str,
        wall_s: float,
        gpus: Mapping[int, GpuSample],
        found: list[tuple[int, GpuProcessSample]],
        tree: ProcessCpu | None,
        cpu_base: Mapping[tuple[int, float], float],
    ) -> tuple[float, BusyBasis]:
        if found and all(process.sm_util_pct is not None for _, process in found):
            sm_pct: defaultdict[int, int] = defaultdict(int)
            for index, process in found:
                sm_pct[index] += process.sm_util_pct or 0
            # Several processes of one worker on one GPU (or sampling jitter) can add past 100.
            total_pct = sum(min(100, pct) for pct in sm_pct.values())
            return min(wall_s, wall_s * total_pct / (100 * len(sm_pct))), BusyBasis.GPU_PROCESS
        indexes = sorted({index for index, _ in found}) or self._worker_gpus.get(name, ())
        device_pct = [gpus[i].utilization_gpu_pct if i in gpus else None for i in indexes]
        if device_pct and None not in device_pct:
            total_pct = sum(pct or 0 for pct in device_pct)
            return min(wall_s, wall_s * total_pct / (100 * len(device_pct))), BusyBasis.GPU_DEVICE
        if tree is not None:
            base = cpu_base.get((tree.pid, tree.create_time))
            # Without a baseline (a new or restarted process) the interval's share is unknown.
            if base is not None:
                cpu_s = max(0.0, tree.cpu_s - base)
                return min(wall_s, cpu_s / tree.num_cpus), BusyBasis.HOST_CPU
        return wall_s, BusyBasis.ASSUMED_BUSY
