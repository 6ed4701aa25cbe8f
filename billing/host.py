"""Host telemetry through psutil: the machine's CPU and memory, and a worker's CPU seconds.

A worker without a GPU (vLLM on CPU) is busy when its processes run on the CPUs it may use, so
its busy time is read from the CPU seconds of its whole process tree: vLLM runs the engine in a
child process, and the API server alone would look idle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import psutil


@dataclass(frozen=True, slots=True)
class HostSample:
    """The machine, as of one sample."""

    cpu_pct: float
    """Average over all CPUs since the previous sample, 0..100."""
    num_cpus: int
    """Logical CPUs."""
    memory_used_bytes: int
    """Total minus available: page cache the kernel would give back does not count."""
    memory_total_bytes: int


@dataclass(frozen=True, slots=True)
class ProcessCpu:
    """A process tree's CPU use since the root process started."""

    pid: int
    create_time: float
    """With ``pid``, the process's identity: a reused pid has another start time."""
    cpu_s: float
    """User + system seconds of the process, its live descendants, and every child any of them
    has reaped. A descendant that exits unreaped takes its seconds with it, so between two
    readings this may go down: callers clamp the difference at zero."""
    num_cpus: int
    """CPUs the process may run on (its affinity): the most CPU seconds it can use per second."""
    pids: frozenset[int]
    """The root and every live descendant."""


class HostTelemetry(Protocol):
    """Where the telemetry loop reads the host (``HostCollector``; a fake process table in
    tests)."""

    def sample(self) -> HostSample:
        """The machine now."""
        ...

    def process_cpu(self, pid: int) -> ProcessCpu | None:
        """The CPU use of ``pid``'s process tree; ``None`` when the process is gone or not
        readable."""
        ...


class HostCollector:
    """``HostTelemetry`` over psutil."""

    def __init__(self) -> None:
        # The first cpu_percent() call only sets psutil's baseline (it answers 0.0).
        psutil.cpu_percent(interval=None)

    def sample(self) -> HostSample:
        """The machine now; CPU since the previous call (or since construction)."""
        memory = psutil.virtual_memory()
        return HostSample(
            cpu_pct=psutil.cpu_percent(interval=None),
            num_cpus=psutil.cpu_count(logical=True) or 1,
            memory_used_bytes=memory.total - memory.available,
            memory_total_bytes=memory.total,
        )

    def process_cpu(self, pid: int) -> ProcessCpu | None:
        """The CPU use of ``pid``'s process tree, or ``None`` when it is gone."""
        try:
            root = psutil.Process(pid)
            with root.oneshot():
                create_time = root.create_time()
                cpu_s = _cpu_s(root)
                num_cpus = _num_cpus(root)
            descendants = root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        pids = {pid}
        for child in descendants:
            # A child exiting between the listing and this read is simply not counted.
            try:
                cpu_s += _cpu_s(child)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            pids.add(child.pid)
        return ProcessCpu(
            pid=pid, create_time=create_time, cpu_s=cpu_s, num_cpus=num_cpus, pids=frozenset(pids)
        )


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def _num_cpus(process: psutil.Process) -> int:
    try:
        return len(process.cpu_affinity() or ()) or psutil.cpu_count(logical=True) or 1
    except AttributeError:  # no cpu_affinity() on macOS
        return psutil.cpu_count(logical=True) or 1
