"""``bench.overhead.core_contention``: the groups it runs and one loop's timing."""

from __future__ import annotations

import os

import pytest

import bench.overhead.core_contention as contention


def test_groups_double_up_to_every_core() -> None:
    assert contention.group_sizes(16) == [1, 2, 4, 8, 16]
    assert contention.group_sizes(6) == [1, 2, 4, 6]
    assert contention.group_sizes(1) == [1]


@pytest.mark.parametrize("kind", ["cpu", "cache"])
def test_each_pinned_loop_reports_its_time(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(contention, "_CPU_STEPS", 10_000)
    monkeypatch.setattr(contention, "_DICT_ENTRIES", 1_000)
    monkeypatch.setattr(contention, "_LOOKUPS", 1_000)
    cores = sorted(os.sched_getaffinity(0))[:2]
    times = contention.run_group(kind, cores)
    assert len(times) == len(cores) and all(0 < t < 5 for t in times)
