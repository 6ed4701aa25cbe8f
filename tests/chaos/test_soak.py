"""The chaos soak's short version (issue 25): ``bench.soak`` for ``TANDEM_SOAK_MINUTES`` (3)
on its own real stack (two gateway processes, Redis, PostgreSQL, one prefill and one decode
vLLM CPU worker), every fault kind injected at least once, and every invariant must hold.

The directory sorts before ``tests/e2e``: the soak's stack has come and gone before the
end-to-end session boots its own, so the two never share the machine's memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console

from bench.soak import report
from bench.soak.faults import FaultKind
from bench.soak.run import SoakSpec, run_soak

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(2400)
async def test_soak_keeps_every_invariant(tmp_path: Path) -> None:
    minutes = float(os.environ.get("TANDEM_SOAK_MINUTES", "3"))
    result = await run_soak(SoakSpec(workdir=tmp_path / "soak", minutes=minutes, gap_s=5))

    console = Console(width=200, record=True)
    for table in (report.requests_table(result), report.faults_table(result),
                  report.checks_table(result)):  # fmt: skip
        console.print(table)
    figures = console.export_text()
    print(figures)  # in the CI log, held or not
    assert {fault.kind for fault in result.faults} == set(FaultKind), figures
    assert sum(1 for s in result.sent if s.kind == "load" and s.record.ok) > 0, figures
    failed = [check.name for check in result.checks if not check.ok]
    assert not failed, f"invariants failed: {failed}\n{figures}\nlogs: {tmp_path / 'soak'}"
