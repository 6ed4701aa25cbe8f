"""bench.kv_transfer's ``nice`` form, its parts that need no workers: finding the threads Tandem
lowered from ``/proc``, the order of each pair, and the table's arithmetic (medians of each side,
and the lowered side against a memcpy of the same bytes)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from bench.kv_transfer.thread_nice import PairedRow, lowered_threads, pair_orders


def test_the_threads_below_the_main_threads_priority_are_found_with_their_value() -> None:
    release = threading.Event()
    ready = threading.Event()

    def helper() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # raising needs no root
        ready.set()
        release.wait()

    thread = threading.Thread(target=helper)
    thread.start()
    try:
        ready.wait(5)
        assert thread.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == 19
        assert lowered_threads(os.getpid()) == ([thread.native_id], 19)
    finally:
        release.set()
        thread.join()


def test_a_worker_without_lowered_threads_is_refused_with_the_reason() -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(RuntimeError, match="TANDEM_NIXL_THREAD_NICE"):
            lowered_threads(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_pairs_alternate_which_nice_value_goes_first() -> None:
    assert list(pair_orders(4, 19)) == [(0, 19), (19, 0), (0, 19), (19, 0)]


def test_the_row_compares_the_medians_of_each_side() -> None:
    row = PairedRow(
        tokens=990,
        lowered=19,
        xfer_s={0: [0.020, 0.018, 0.030], 19: [0.010, 0.012, 0.011]},
        handoff_s={0: [0.100, 0.120, 0.110], 19: [0.090, 0.080, 0.085]},
        memcpy_s=0.0025,
    )
    assert row.render().split() == ["990", "3", "20.0", "11.0", "0.55", "2.50", "4.4", "110", "85"]
