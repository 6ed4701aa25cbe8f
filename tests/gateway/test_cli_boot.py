"""``tandem up``'s boot progress when its console is not a terminal (``> log``, CI)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from gateway.cli.main import BootProgress
from tests.workers.test_pool import pool_config
from workers.pool import WorkerPool, WorkerStatus

PREFILL = WorkerStatus(
    name="prefill-0",
    base_url="http://127.0.0.1:8100",
    healthy=False,
    managed=True,
    pid=101,
    last_exit_code=None,
    num_restarts=0,
    log_path=Path(".tandem/logs/prefill-0.log"),
)
DECODE = replace(PREFILL, name="decode-0", base_url="http://127.0.0.1:8200", pid=102)
EXTERNAL = replace(
    PREFILL, name="decode-ext-0", base_url="http://gpu:8000", managed=False, pid=None
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _plain_console() -> tuple[Console, io.StringIO]:
    log = io.StringIO()
    return Console(file=log, force_terminal=False, width=200), log


def test_start_every_interval_then_ready_with_the_time_it_took() -> None:
    console, log = _plain_console()
    clock = FakeClock()
    progress = BootProgress(console, interval_s=10, clock=clock)
    # Ticks about every second, as the pools' progress callbacks come.
    for second in range(0, 94):
        clock.now = 1000.0 + second
        prefill_ready = second >= 93
        decode_ready = second >= 41
        progress.update(
            [
                replace(PREFILL, healthy=prefill_ready),
                replace(DECODE, healthy=decode_ready),
                replace(EXTERNAL, healthy=second >= 5),
            ]
        )

    lines = log.getvalue().splitlines()
    assert [line for line in lines if line.startswith("prefill-0")] == [
        "prefill-0: starting",
        *(f"prefill-0: starting ({s} s)" for s in range(10, 93, 10)),
        "prefill-0: ready in 93 s",
    ]
    assert [line for line in lines if line.startswith("decode-0")] == [
        "decode-0: starting",
        *(f"decode-0: starting ({s} s)" for s in (10, 20, 30, 40)),
        "decode-0: ready in 41 s",
    ]
    assert [line for line in lines if line.startswith("decode-ext-0")] == [
        "decode-ext-0: waiting for http://gpu:8000",
        "decode-ext-0: ready in 5 s",
    ]


def test_a_late_tick_prints_one_line_not_a_backlog() -> None:
    console, log = _plain_console()
    clock = FakeClock()
    progress = BootProgress(console, interval_s=10, clock=clock)
    progress.update([PREFILL])
    clock.now += 35  # the event loop was busy: no tick for 35 s
    progress.update([PREFILL])
    clock.now += 1
    progress.update([PREFILL])
    assert log.getvalue().splitlines() == ["prefill-0: starting", "prefill-0: starting (35 s)"]


async def test_a_real_pool_reports_start_and_ready(tmp_path: Path) -> None:
    console, log = _plain_console()
    pool = WorkerPool(pool_config(tmp_path, {}, {}))
    progress = BootProgress(console)
    await pool.start()
    try:
        await pool.wait_ready(
            timeout_s=30, on_progress=lambda _line: progress.update(pool.status())
        )
    finally:
        await pool.aclose()
    lines = log.getvalue().splitlines()
    for name in ("prefill-0", "prefill-1"):
        assert f"{name}: starting" in lines
        (ready,) = [line for line in lines if line.startswith(f"{name}: ready in ")]
        assert ready.endswith(" s")
    assert "\x1b" not in log.getvalue()  # plain text: no spinner, no colour codes
