"""``python -m bench.quota_check`` runs and prints a figure per level (the figures themselves
are the host's: never asserted)."""

from __future__ import annotations

import pytest

from bench.quota_check import main


def test_prints_one_line_per_level(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--open", "4,64", "--requests", "200", "--repeat", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("holds open")
    assert [line.split()[0] for line in lines[1:]] == ["4", "64"]
    assert all(float(line.split()[1]) > 0 for line in lines[1:])
