"""``bench.overhead.ttft_steps``: the step table from the marks, and marks that still fit the
serving path's functions (a renamed one must fail, not silently drop its step)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.overhead.ttft_steps import head_to_route_ms, step_table


def test_steps_are_medians_after_the_route_and_after_the_step_before() -> None:
    records = [
        {"route": 10.0, "auth_done": 10.001, "admit_start": 10.003, "admit_end": 10.004},
        {"route": 20.0, "auth_done": 20.002, "admit_start": 20.005, "admit_end": 20.009},
        {"route": 30.0, "auth_done": 30.003, "admit_start": 30.004},  # never admitted
    ]
    rows = {step: (round(at, 6), round(gap, 6), n) for step, at, gap, n in step_table(records)}
    assert list(rows) == ["auth_done", "admit_start", "admit_end"]  # STEPS order, seen ones only
    assert rows["auth_done"] == (2.0, 2.0, 3)
    assert rows["admit_start"] == (4.0, 2.0, 3)
    assert rows["admit_end"] == (6.5, 2.5, 2)


def test_the_time_before_the_route_is_the_median_from_the_head() -> None:
    records = [
        {"head": 9.999, "route": 10.0},
        {"head": 19.997, "route": 20.0},
        {"route": 30.0},  # served by another server: no head mark
        {"head": 39.998, "route": 40.0},
    ]
    assert head_to_route_ms(records) == pytest.approx(2.0)
    assert head_to_route_ms([{"route": 1.0}]) is None


def test_the_marks_fit_the_serving_path() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "import bench.overhead.ttft_marks as m; m.install()"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
