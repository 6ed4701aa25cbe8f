"""What the host did to every process over a benchmark's window: CPU time the hypervisor stole,
and the kernel's pressure-stall accounting (PSI) for CPU, memory and IO.

A load generator that stalls cannot tell on its own whether it was starved or the whole machine
was: these counters can. They are Linux's: ``/proc/stat``'s ``cpu`` line (jiffies, ``USER_HZ``
a second) and ``/proc/pressure/{cpu,memory,io}`` (microseconds during which some, or all,
runnable tasks waited on that resource). A host without PSI reports its steal time alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
RESOURCES = ("cpu", "memory", "io")


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


def sample(proc: Path = PROC) -> HostSample:
    """The host's counters now (cheap: four small reads)."""
    steal_s, iowait_s = parse_cpu_line((proc / "stat").read_text(), os.sysconf("SC_CLK_TCK"))
    stalled: dict[str, int] = {}
    for resource in RESOURCES:
        try:
            stalled |= parse_pressure(resource, (proc / "pressure" / resource).read_text())
        except OSError:  # no PSI (kernel built without it, or a container hiding it)
            return HostSample(steal_s, iowait_s)
    return HostSample(steal_s, iowait_s, stalled)


def describe(before: HostSample, after: HostSample, elapsed_s: float) -> str:
    """One line: steal and iowait seconds over the window, and each PSI total as a share of it."""
    parts = [
        f"CPU steal {after.steal_s - before.steal_s:.1f} s",
        f"iowait {after.iowait_s - before.iowait_s:.1f} s",
    ]
    if not (before.stalled_us and after.stalled_us):
        return ", ".join([*parts, "no PSI on this host"]) + f" (over {elapsed_s:.1f} s)"
    shares = [
        f"{key} {100 * (after.stalled_us[key] - before.stalled_us[key]) / 1e6 / elapsed_s:.0f}%"
        for key in after.stalled_us
        if key in before.stalled_us
    ]
    return ", ".join(parts) + f"; stalled on {', '.join(shares)} (of {elapsed_s:.1f} s)"
