"""``bench.token_counting`` runs end to end on a tokenizer every machine has and prints both
of its tables (figures only: nothing here compares times)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.token_counting import main, texts_of
from tests.bench.tokenizer import trained_tokenizer


def test_texts_are_distinct_and_of_the_length_asked() -> None:
    words = [f"w{i}" for i in range(1_000)]
    texts = texts_of(words, 10, 50)
    assert len(set(texts)) == 50
    assert all(len(text.split()) == 10 for text in texts)


def test_it_prints_both_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained_tokenizer().save(str(tmp_path / "tokenizer.json"))
    main(["--repeat", "1", "--model-dir", str(tmp_path)])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()]
    per_text = [row for row in rows if len(row) == 5 and row[0].isdigit()]
    assert [row[0] for row in per_text] == ["10", "100", "1000", "4000"]
    turns = [row for row in rows if len(row) == 4 and row[0].isdigit()]
    assert [(row[0], row[1]) for row in turns] == [
        ("1", "1"),
        ("5", "9"),
        ("10", "19"),
        ("20", "39"),
    ]
    assert all(float(value) > 0 for row in per_text + turns for value in row[2:])
