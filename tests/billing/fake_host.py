"""A fake process table (``billing.host.HostTelemetry``) and a fake clock for the billing
tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from billing.host import HostSample, ProcessCpu


@dataclass
class FakeClock:
    """Seconds, set by the test."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeHost:
    """A host whose processes the test writes: pid -> its tree's CPU use."""

    cpu_pct: float = 25.0
    num_cpus: int = 16
    memory_used_bytes: int = 8 * 2**30
    memory_total_bytes: int = 64 * 2**30
    processes: dict[int, ProcessCpu] = field(default_factory=dict)

    def set_process(
        self,
        pid: int,
        cpu_s: float = 0.0,
        *,
        children: Iterable[int] = (),
        num_cpus: int = 4,
        create_time: float = 1000.0,
    ) -> None:
        """Put (or update) ``pid``'s process tree in the table."""
        self.processes[pid] = ProcessCpu(
            pid=pid,
            create_time=create_time,
            cpu_s=cpu_s,
            num_cpus=num_cpus,
            pids=frozenset({pid, *children}),
        )

    def add_cpu(self, pid: int, cpu_s: float) -> None:
        """``pid``'s tree used ``cpu_s`` more CPU seconds."""
        p = self.processes[pid]
        self.set_process(
            pid, p.cpu_s + cpu_s, children=p.pids, num_cpus=p.num_cpus, create_time=p.create_time
        )

    def sample(self) -> HostSample:
        return HostSample(
            cpu_pct=self.cpu_pct,
            num_cpus=self.num_cpus,
            memory_used_bytes=self.memory_used_bytes,
            memory_total_bytes=self.memory_total_bytes,
        )

    def process_cpu(self, pid: int) -> ProcessCpu | None:
        return self.processes.get(pid)
