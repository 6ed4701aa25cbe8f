"""What the host did over a benchmark's window: CPU time the hypervisor stole, the kernel's
pressure-stall accounting (PSI) for CPU, memory and IO, and how long the sampling thread itself
ran and waited for a CPU.

A load generator that stalls cannot tell on its own whether it was starved or the whole machine
was: these counters can. They are Linux's: ``/proc/stat``'s ``cpu`` line (jiffies, ``USER_HZ``
a second); ``/proc/pressure/{cpu,memory,io}`` (microseconds during which some, or all, runnable
tasks waited on that resource); and ``/proc/thread-self/schedstat`` (nanoseconds the sampling
thread, an event loop's, spent on a CPU and runnable on a run queue). A loop that stalled while
its wait grew by as much was starved of CPU (the process's nice value is printed too); one whose
wait did not grow was blocked, or the whole machine was stopped (steal). Counters a host lacks
are left out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
RESOURCES = ("cpu", "memory", "io")


@dataclass(frozen=True)
class ThreadTimes:
    """One thread's scheduler times so far (``/proc/thread-self/schedstat``)."""

    ran_s: float
    """On a CPU."""
    waited_s: float
    """Runnable, but waiting on a run queue for a CPU."""


@dataclass(frozen=True)
class HostSample:
    """The host's cumulative counters at one moment."""

    steal_s: float
    """All CPUs' time stolen by the hypervisor so far."""
    iowait_s: float
    """All CPUs' idle time with IO outstanding so far."""
    stalled_us: dict[str, int] = field(default_factory=dict)
    """PSI's cumulative stall totals, keyed ``"<resource> some"`` / ``"<resource> full"``; empty
    where the kernel has no PSI."""
    thread: ThreadTimes | None = None
    """The sampling thread's; None where the kernel keeps no scheduler statistics."""


def parse_cpu_line(stat_text: str, hz: int) -> tuple[float, float]:
    """(steal, iowait) seconds from ``/proc/stat``'s aggregate ``cpu`` line."""
    for line in stat_text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            # user nice system idle iowait irq softirq steal ...
            return int(fields[8]) / hz, int(fields[5]) / hz
    raise ValueError("/proc/stat has no aggregate 'cpu' line")


def parse_pressure(resource: str, text: str) -> dict[str, int]:
    """``{"<resource> some": total_us, "<resource> full": total_us}`` from a PSI file."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        kind, *pairs = line.split()
        totals = [pair.split("=", 1)[1] for pair in pairs if pair.startswith("total=")]
        if totals:
            out[f"{resource} {kind}"] = int(totals[0])
    return out


def parse_schedstat(text: str) -> ThreadTimes:
    """A ``schedstat`` file's nanoseconds on a CPU and waiting for one (then its timeslices)."""
    ran_ns, waited_ns, _slices = text.split()
    return ThreadTimes(int(ran_ns) / 1e9, int(waited_ns) / 1e9)


def sample(proc: Path = PROC) -> HostSample:
    """The host's counters now, and the calling thread's (cheap: five small reads)."""
    steal_s, iowait_s = parse_cpu_line((proc / "stat").read_text(), os.sysconf("SC_CLK_TCK"))
    stalled: dict[str, int] = {}
    for resource in RESOURCES:
        try:
            stalled |= parse_pressure(resource, (proc / "pressure" / resource).read_text())
        except OSError:  # no PSI (kernel built without it, or a container hiding it)
            stalled = {}
            break
    try:
        thread = parse_schedstat((proc / "thread-self" / "schedstat").read_text())
    except OSError:  # a kernel without scheduler statistics
        thread = None
    return HostSample(steal_s, iowait_s, stalled, thread)


def describe(before: HostSample, after: HostSample, elapsed_s: float) -> str:
    """One line over the window: steal and iowait seconds, each PSI total as a share of the
    window, and the sampling thread's time on a CPU and waiting for one (at the process's nice)."""
    line = (
        f"CPU steal {after.steal_s - before.steal_s:.1f} s, "
        f"iowait {after.iowait_s - before.iowait_s:.1f} s"
    )
    if before.stalled_us and after.stalled_us:
        shares = [
            f"{key} {100 * (after.stalled_us[key] - before.stalled_us[key]) / 1e6 / elapsed_s:.0f}%"
            for key in after.stalled_us
            if key in before.stalled_us
        ]
        line += f"; stalled on {', '.join(shares)}"
    else:
        line += ", no PSI on this host"
    if before.thread is not None and after.thread is not None:
        line += (
            f"; this thread on a CPU {after.thread.ran_s - before.thread.ran_s:.1f} s, waiting "
            f"for one {after.thread.waited_s - before.thread.waited_s:.1f} s "
            f"at nice {os.getpriority(os.PRIO_PROCESS, 0)}"
        )
    return line + f" (of {elapsed_s:.1f} s)"
