"""``bench.quota_store_calls`` runs end to end against a redis-server of its own and prints a
row per level with both figures (figures only: nothing here compares times). Its pipelined
floor sends the store's own scripts, so a script the store changes breaks it here first."""

from __future__ import annotations

import math

import pytest

from bench.quota_store_calls import main


def test_it_prints_both_figures_per_level(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--concurrency", "1,3", "--pairs", "6"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    levels = [row for row in rows if len(row) == 3 and row[0].isdigit()]
    assert [row[0] for row in levels] == ["1", "3"]
    for _, store_us, floor_us in levels:
        assert math.isfinite(float(store_us)) and float(store_us) > 0
        assert math.isfinite(float(floor_us)) and float(floor_us) > 0
