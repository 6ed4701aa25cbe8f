"""bench.kv_transfer.cma_ceiling: real process_vm_readv reads from a holder process."""

from __future__ import annotations

import os

import pytest

from bench.kv_transfer import cma_ceiling
from bench.kv_transfer.cma_ceiling import Slice, main, measure


def test_reads_on_either_pages_print_a_row_each(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--mib", "4", "--iov-kib", "64", "--threads", "1", "--repeats", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:3] == ["pages", "huge", "threads"]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["huge", "small"]
    assert all(row[2] == "1" and float(row[6]) > 0 for row in rows)  # threads, GB/s


def test_a_copy_that_differs_from_the_holders_bytes_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exact = Slice.of

    def off_by_one(
        pid: int, local_base: int, remote_base: int, start: int, end: int, iov_bytes: int
    ) -> Slice:
        return exact(pid, local_base, remote_base + 1, start, end - 1, iov_bytes)

    monkeypatch.setattr(cma_ceiling.Slice, "of", off_by_one)
    with pytest.raises(AssertionError, match="differs from the holder's bytes"):
        measure(1 << 20, 64 << 10, [1], "small", repeats=1)


def test_more_threads_than_cores_is_refused_before_reading() -> None:
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit, match=f"needs as many cores; this process may use {cores}"):
        measure(1 << 20, 64 << 10, [cores + 1], "huge", repeats=1)
