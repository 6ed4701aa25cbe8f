"""bench/host_pressure.py: steal and iowait come from /proc/stat's aggregate line, PSI totals
from its files, and a window's line gives each as a share of the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import host_pressure
from bench.host_pressure import HostSample

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


def test_a_host_without_psi_reports_steal_alone(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(STAT)
    measured = host_pressure.sample(tmp_path)
    assert measured.stalled_us == {} and measured.steal_s > 0
    line = host_pressure.describe(measured, measured, 10.0)
    assert line == "CPU steal 0.0 s, iowait 0.0 s, no PSI on this host (over 10.0 s)"


def test_the_window_gives_each_stall_total_as_a_share_of_it() -> None:
    before = HostSample(1.0, 2.0, {"cpu some": 0, "memory full": 5_000_000})
    after = HostSample(3.5, 2.0, {"cpu some": 4_000_000, "memory full": 5_000_000})
    assert host_pressure.describe(before, after, 20.0) == (
        "CPU steal 2.5 s, iowait 0.0 s; stalled on cpu some 20%, memory full 0% (of 20.0 s)"
    )


def test_this_host_is_sampled() -> None:
    measured = host_pressure.sample()
    assert measured.steal_s >= 0 and measured.iowait_s >= 0
    assert all(total >= 0 for total in measured.stalled_us.values())
