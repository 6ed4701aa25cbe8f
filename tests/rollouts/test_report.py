"""rollouts.report on synthetic rollouts: the four files are written, the PNGs are PNGs of some
size, the decision log names every event and tabulates measurements, report.json reads back as
the same data, and missing samples or weights still make a report."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from rollouts.gates import Gate, GateKind, Measurement, Verdict
from rollouts.report import ReportData, decision_log, write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC


def measurement(verdict: Verdict, candidate: float, baseline: float) -> dict[str, Any]:
    return Measurement(
        gate=Gate(GateKind.TTFT_P95, max_ratio=1.1, failure_limit=2),
        verdict=verdict,
        candidate_value=candidate,
        baseline_value=baseline,
        num_samples=300,
        baseline_samples=310,
        p_value=0.001 if verdict is Verdict.FAIL else None,
        detail=f"TTFT p95 {candidate:.3f} s against the baseline's {baseline:.3f} s | noted",
    ).to_dict()


def rolled_back(*, samples: bool = True) -> ReportData:
    rng = random.Random(7)
    ttft = {
        "chat-v1": [rng.lognormvariate(-1.5, 0.5) for _ in range(300)],
        "chat-v2": [1.2 * rng.lognormvariate(-1.5, 0.5) for _ in range(300)],
    }
    itl = {
        "chat-v1": [rng.lognormvariate(-3.5, 0.3) for _ in range(300)],
        "chat-v2": [rng.lognormvariate(-3.5, 0.3) for _ in range(300)],
    }
    return ReportData(
        rollout_id="ro-42",
        alias="chat",
        baseline="chat-v1",
        candidate="chat-v2",
        status="rolled_back",
        weights=((T0, 0.0), (T0 + 1, 5.0), (T0 + 61, 25.0), (T0 + 125, 0.0)),
        decisions=(
            {"at": T0, "event": "started", "detail": "canary of chat-v2", "weight": 5.0},
            {
                "at": T0 + 60,
                "event": "step_passed",
                "detail": "every gate passed",
                "weight": 25.0,
                "measurements": [measurement(Verdict.PASS, 0.31, 0.30)],
            },
            {
                "at": T0 + 120,
                "event": "failed",
                "detail": "ttft_p95 failed twice in a row",
                "weight": 25.0,
                "measurements": [measurement(Verdict.FAIL, 0.42, 0.30)],
            },
            {"at": T0 + 125, "event": "rolled_back", "detail": "all traffic to chat-v1"},
        ),
        ttft_s=ttft if samples else {"chat-v1": [], "chat-v2": []},
        itl_s=itl if samples else {},
    )


def assert_png(path: Path) -> None:
    content = path.read_bytes()
    assert content.startswith(PNG_SIGNATURE), path
    assert len(content) > 10_000, (path, len(content))


def test_write_report_writes_the_four_files(tmp_path: Path) -> None:
    folder = tmp_path / "reports" / "ro-42"  # created, parents too
    paths = write_report(rolled_back(), folder)

    assert paths == [
        folder / name for name in ("latency.png", "weights.png", "decisions.md", "report.json")
    ]
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in paths)
    assert_png(paths[0])
    assert_png(paths[1])


def test_the_decision_log_names_every_event_and_tabulates_measurements(tmp_path: Path) -> None:
    [*_, log_path, _] = write_report(rolled_back(), tmp_path)
    text = log_path.read_text(encoding="utf-8")
    lines = text.splitlines()

    assert lines[0] == "# Rollout ro-42: chat"
    assert "- Baseline: `chat-v1`" in lines
    assert "- Candidate: `chat-v2`" in lines
    assert "- Status: **rolled_back**" in lines
    decisions = [line for line in lines if line.startswith("- 2023-")]
    assert decisions == [
        "- 2023-11-14 22:13:20 UTC · **started** · weight 5 % · canary of chat-v2",
        "- 2023-11-14 22:14:20 UTC · **step_passed** · weight 25 % · every gate passed",
        "- 2023-11-14 22:15:20 UTC · **failed** · weight 25 % · ttft_p95 failed twice in a row",
        "- 2023-11-14 22:15:25 UTC · **rolled_back** · weight - · all traffic to chat-v1",
    ]
    headers = [
        line for line in lines if "| gate | verdict | candidate | baseline | samples |" in line
    ]
    assert len(headers) == 2
    rows = [line.strip() for line in lines if line.strip().startswith("| ttft_p95")]
    assert rows == [
        "| ttft_p95 | pass | 0.31 | 0.3 | 300 | TTFT p95 0.310 s against the baseline's 0.300 s \\| noted |",
        "| ttft_p95 | fail | 0.42 | 0.3 | 300 | TTFT p95 0.420 s against the baseline's 0.300 s \\| noted |",
    ]
    # Each table sits under its own decision, before the next one.
    at = [lines.index(line) for line in decisions]
    passed = next(i for i, line in enumerate(lines) if "| pass |" in line)
    failed = next(i for i, line in enumerate(lines) if "| fail |" in line)
    assert at[1] < passed < at[2] < failed < at[3]
    assert text == decision_log(rolled_back())


def test_report_json_reads_back_as_the_same_data(tmp_path: Path) -> None:
    data = rolled_back()
    [*_, json_path] = write_report(data, tmp_path)
    raw = json.loads(json_path.read_text(encoding="utf-8"))

    assert raw["rollout_id"] == "ro-42"
    assert raw["status"] == "rolled_back"
    assert raw["weights"][1] == [T0 + 1, 5.0]
    assert raw["decisions"][2]["measurements"][0]["verdict"] == "fail"
    back = ReportData.from_dict(raw)
    assert back.to_dict() == data.to_dict()
    assert back.weights == data.weights
    assert back.decisions == tuple(data.decisions)
    assert {name: list(v) for name, v in back.ttft_s.items()} == data.ttft_s


def test_empty_samples_and_weights_still_make_a_report(tmp_path: Path) -> None:
    data = rolled_back(samples=False)
    paths = write_report(data, tmp_path)
    assert_png(paths[0])
    assert_png(paths[1])

    no_weights = ReportData(
        rollout_id="ro-1",
        alias="chat",
        baseline="a",
        candidate="b",
        status="aborted",
        weights=(),
        decisions=(),
        ttft_s={"a": [0.1]},  # one sample on one side only
        itl_s={},
    )
    paths = write_report(no_weights, tmp_path / "empty")
    assert_png(paths[0])
    assert_png(paths[1])
    assert "No decisions recorded." in paths[2].read_text(encoding="utf-8")
    assert ReportData.from_dict(json.loads(paths[3].read_text(encoding="utf-8"))) == ReportData(
        "ro-1", "chat", "a", "b", "aborted", (), (), {"a": (0.1,)}, {}
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weights": ((T0, 101.0),)}, "weights"),
        ({"weights": ((T0, float("nan")),)}, "weights"),
        ({"decisions": ({"at": T0, "event": "started"},)}, r"decisions\[0\] lacks detail"),
    ],
)
def test_bad_data_is_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    fields = rolled_back().to_dict() | change
    with pytest.raises(ValueError, match=message):
        ReportData(**fields)
