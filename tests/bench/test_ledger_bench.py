"""bench.ledger writes: a tiny SQLite run through the CLI prints its tables and saves figures
that add up (every submitted record committed, every rate and cost positive)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.ledger.cli import main


def test_writes_on_sqlite_prints_and_saves_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "writes.json"
    argv = ["writes", "--backend", "sqlite", "--records", "200", "--seconds", "0.3"]
    assert main([*argv, "--rates", "2000", "--json", str(out)]) == 0

    printed = capsys.readouterr().out
    assert "LedgerWriter, sustained" in printed
    assert "insert_usage alone" in printed
    assert "MISMATCH" not in printed
    (result,) = json.loads(out.read_text())["results"]
    assert result["backend"] == "sqlite"
    assert "synchronous=FULL" in result["durability"]

    saturating, paced = result["sustained"]
    assert (saturating["producer"], paced["producer"]) == ("saturating", "paced 2,000/s")
    assert 300 <= paced["num_submitted"] <= 700  # about 2000/s for 0.3 s
    for run in (saturating, paced):
        assert run["num_submitted"] > 0
        assert run["num_committed"] == run["num_submitted"]
        assert run["flushed"] and run["num_write_failures"] == 0
        assert run["committed_per_s"] > 0 and run["offered_per_s"] > 0
        assert run["submit_us"]["n"] == run["num_submitted"] and run["submit_us"]["p50"] > 0
    idle = result["submit_idle_us"]
    assert idle["n"] == 200 and idle["p50"] > 0 and idle["p99"] >= idle["p50"]

    assert [batch["batch_size"] for batch in result["batches"]] == [1, 100, 1000]
    for batch in result["batches"]:
        assert 0 < batch["num_records"] <= 200
        assert batch["rows_per_s"] > 0 and batch["batch_ms"]["p50"] > 0
