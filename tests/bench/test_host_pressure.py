"""bench/host_pressure.py: steal and iowait come from /proc/stat's aggregate line, PSI totals
from its files, the thread's times from its schedstat, and a window's line gives each over the
window."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench import host_pressure
from bench.host_pressure import HostSample, ThreadTimes

STAT = """cpu  1819419 3544 436373 1916428 29191 0 5535 4761 0 0
cpu0 909709 1772 218186 958214 14595 0 2767 2380 0 0
intr 12345
"""
PRESSURE = """some avg10=0.04 avg60=2.34 avg300=18.01 total=3582695236
full avg10=0.00 avg60=0.00 avg300=0.00 total=17
"""


def test_the_aggregate_cpu_line_gives_steal_then_iowait() -> None:
    assert host_pressure.parse_cpu_line(STAT, hz=100) == (47.61, 291.91)


def test_a_stat_without_the_aggregate_line_is_refused() -> None:
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        host_pressure.parse_cpu_line("cpu0 1 2 3 4 5 6 7 8\n", hz=100)


def test_each_pressure_line_gives_its_total() -> None:
    assert host_pressure.parse_pressure("io", PRESSURE) == {"io some": 3582695236, "io full": 17}


def test_a_schedstat_gives_seconds_on_a_cpu_then_waiting() -> None:
    assert host_pressure.parse_schedstat("339770917 731500 41\n") == ThreadTimes(
        0.339770917, 0.0007315
    )


def test_a_host_without_psi_or_schedstat_reports_steal_alone(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(STAT)
    measured = host_pressure.sample(tmp_path)
    assert measured.stalled_us == {} and measured.thread is None and measured.steal_s > 0
    line = host_pressure.describe(measured, measured, 10.0)
    assert line == "CPU steal 0.0 s, iowait 0.0 s, no PSI on this host (of 10.0 s)"


def test_the_window_gives_each_stall_total_as_a_share_and_the_threads_times() -> None:
    before = HostSample(1.0, 2.0, {"cpu some": 0, "memory full": 5_000_000}, ThreadTimes(1.0, 0.5))
    after = HostSample(
        3.5, 2.0, {"cpu some": 4_000_000, "memory full": 5_000_000}, ThreadTimes(1.25, 19.0)
    )
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    assert host_pressure.describe(before, after, 20.0) == (
        "CPU steal 2.5 s, iowait 0.0 s; stalled on cpu some 20%, memory full 0%; this thread on "
        f"a CPU 0.2 s, waiting for one 18.5 s at nice {nice} (of 20.0 s)"
    )


def test_this_host_and_thread_are_sampled() -> None:
    before = host_pressure.sample()
    # 0.2 s of this thread's own CPU time (not the wall clock's, which a busy host stretches)
    deadline = time.thread_time() + 0.2
    while time.thread_time() < deadline:
        pass
    after = host_pressure.sample()
    assert after.steal_s >= before.steal_s >= 0 and after.iowait_s >= 0
    assert all(total >= 0 for total in after.stalled_us.values())
    assert before.thread is not None and after.thread is not None  # Linux keeps them here
    assert after.thread.ran_s - before.thread.ran_s >= 0.15
