"""``tandem rollout`` against a real gateway (fake engines), and its screen and flags alone.

The gateway runs its rollout controller with a fast tick and one-second windows, so a rollout of
one 50 % step baked for a second goes from start to succeeded in a few seconds while chat
requests flow through the official ``openai`` client.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from rich.console import Console

from gateway.assembly.app import RolloutsConfig
from gateway.cli import rollouts as rollouts_cli
from gateway.cli.main import main
from gateway.cli.rollout_screen import history_table, render
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.versions_stack import ALIAS, VersionsStack, make_versions_stack

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
FAST_GATES = (
    "--gate",
    "ttft_p95:max_ratio=3,min_samples=5",
    "--gate",
    "error_rate:max_value=50%,min_samples=5",
)


async def _tandem(
    capsys: pytest.CaptureFixture[str], stack: VersionsStack, *argv: str
) -> tuple[int, str, str]:
    """``tandem rollout <argv> --url ... --admin-key ...``: exit code, stdout, stderr."""
    code = await asyncio.to_thread(
        main, ["rollout", *argv, "--url", stack.base_url, "--admin-key", ADMIN_KEY]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@contextlib.asynccontextmanager
async def _traffic(client: openai.AsyncOpenAI, concurrency: int = 4) -> AsyncIterator[list[str]]:
    """Chat requests to the alias until the block ends; yields the failures (none expected)."""
    failures: list[str] = []
    stopping = asyncio.Event()

    async def loop() -> None:
        while not stopping.is_set():
            try:
                await client.chat.completions.create(model=ALIAS, messages=QUESTION, max_tokens=4)
            except openai.APIError as exc:
                failures.append(repr(exc))
                await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(loop()) for _ in range(concurrency)]
    try:
        yield failures
    finally:
        stopping.set()
        await asyncio.gather(*tasks)


async def _report_written(stack: VersionsStack, rollout_id: str, timeout_s: float = 20) -> None:
    """The controller writes a report just after it saved the rollout's end."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not (await stack.admin.get(f"/admin/v1/rollouts/{rollout_id}")).json()["report"]:
        assert asyncio.get_running_loop().time() < deadline, "no report"
        await asyncio.sleep(0.1)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[VersionsStack]:
    rollouts = RolloutsConfig(
        tick_s=0.05, lease_ttl_s=2.0, window_bucket_s=1.0, reports_dir=tmp_path / "reports"
    )
    async with make_versions_stack(rollouts=rollouts) as versions_stack:
        await versions_stack.add_version(b"v1")
        yield versions_stack


async def test_a_rollout_started_and_watched_succeeds_and_leaves_its_report(
    stack: VersionsStack, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    baseline, candidate = (version.name for version in stack.versions)
    async with _traffic(stack.client) as failures:
        code, out, err = await _tandem(
            capsys, stack, "start", ALIAS, "--baseline", baseline, "--candidate", candidate,
            "--steps", "50", "--bake", "1s", "--interval", "0.5s", "--grace", "0.5s",
            "--no-quality", *FAST_GATES, "--reason", "ci", "--watch",
        )  # fmt: skip
    assert code == 0, err
    assert not failures
    rollout_id = err.split()[1].rstrip(":")  # "started ro_...: v0 -> v1"
    assert rollout_id.startswith("ro_")
    # Each decision came as a line while watching; then the final screen on stdout.
    assert "step_passed" in err and "succeeded" in err
    assert "succeeded" in out and f"{baseline} -> {candidate}" in out
    assert "ttft_p95" in out and "error_rate" in out and "pass" in out

    code, out, err = await _tandem(capsys, stack, "status", rollout_id)
    assert code == 0, err
    assert "gates at step_passed" in out  # the phase is over: the gates that passed it
    assert "<= x3 baseline" in out and "(min 5)" in out and " ms " in out

    code, out, _ = await _tandem(capsys, stack, "status", ALIAS, "--json")
    shown = json.loads(out)
    assert code == 0 and shown["id"] == rollout_id and shown["status"] == "succeeded"
    assert [g["kind"] for g in shown["spec"]["gates"]] == ["ttft_p95", "error_rate"]
    assert shown["spec"]["quality"]["enabled"] is False
    assert shown["spec"]["steps"] == [{"weight": 50.0, "bake_s": 1.0}]

    code, out, _ = await _tandem(capsys, stack, "status", rollout_id, "--watch")
    assert code == 0  # finished already: the screen once, and its exit code

    code, out, _ = await _tandem(capsys, stack, "history", "--alias", ALIAS)
    assert code == 0
    assert [(r["id"], r["status"]) for r in json.loads(out)["data"]] == [(rollout_id, "succeeded")]

    await _report_written(stack, rollout_id)
    folder = tmp_path / "downloaded"
    code, out, err = await _tandem(capsys, stack, "report", rollout_id, "--out", str(folder))
    assert code == 0, err
    paths = [Path(line) for line in out.splitlines()]
    assert {path.name for path in paths} >= {"decisions.md", "report.json"}
    assert all(path.parent == folder and path.stat().st_size > 0 for path in paths)
    assert json.loads((folder / "report.json").read_text())


async def test_pause_resume_abort_and_errors_on_a_running_rollout(
    stack: VersionsStack, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline, candidate = (version.name for version in stack.versions)
    code, out, err = await _tandem(
        capsys, stack, "start", ALIAS, "--baseline", baseline, "--candidate", candidate,
        "--steps", "10,50", "--bake", "10m", "--no-quality", *FAST_GATES,
    )  # fmt: skip
    assert code == 0, err
    started = json.loads(out)
    rollout_id = started["id"]
    assert started["status"] == "running" and started["phase"] == "canary"

    code, out, err = await _tandem(capsys, stack, "pause", rollout_id, "--reason", "a look")
    assert code == 0, err
    assert json.loads(out)["status"] == "paused" and "pause applied" in err

    code, out, _ = await _tandem(capsys, stack, "status")  # every active rollout
    assert code == 0
    assert rollout_id in out and "paused" in out and "a look" in out
    assert "step 1/2" in out and "10 % on the candidate" in out

    code, out, err = await _tandem(capsys, stack, "resume", rollout_id)
    assert code == 0 and json.loads(out)["status"] == "running", err

    code, out, err = await _tandem(
        capsys, stack, "start", ALIAS, "--baseline", baseline, "--candidate", candidate
    )
    assert code == 1 and "409" in err and "already active" in err  # one per alias

    code, _, err = await _tandem(capsys, stack, "report", rollout_id)
    assert code == 1 and "when it ends" in err

    # A terminal's watch redraws in place until someone aborts the rollout: then exit 2.
    screen = io.StringIO()
    monkeypatch.setattr(rollouts_cli, "out", Console(file=screen, force_terminal=True, width=150))
    connection = ["--url", stack.base_url, "--admin-key", ADMIN_KEY]
    watch = ["rollout", "status", ALIAS, "--watch", "--interval-s", "0.1", *connection]
    watching = asyncio.create_task(asyncio.to_thread(main, watch))
    await asyncio.sleep(0.5)
    assert not watching.done()
    abort = ["rollout", "abort", rollout_id, "--reason", "enough", *connection]
    assert await asyncio.to_thread(main, abort) == 0
    assert await watching == 2
    monkeypatch.undo()
    out, err = capsys.readouterr()  # the abort's (the watch drew on its terminal)
    assert json.loads(out)["status"] == "aborted" and "abort applied" in err
    assert "running" in screen.getvalue() and "aborted by" in screen.getvalue()

    code, _, err = await _tandem(capsys, stack, "abort", rollout_id)
    assert code == 1 and "409" in err and "aborted" in err

    code, out, _ = await _tandem(capsys, stack, "status", rollout_id, "--watch", "--json")
    assert code == 2 and json.loads(out)["status"] == "aborted"  # CI branches on it

    code, out, _ = await _tandem(capsys, stack, "status")
    assert code == 0 and "no active rollout" in out


async def test_errors_are_one_line_and_exit_1(
    stack: VersionsStack, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await _tandem(capsys, stack, "status", "ro_0000000000000000")
    assert code == 1 and "no rollout 'ro_0000000000000000'" in err
    code, _, err = await _tandem(capsys, stack, "pause", "ro_0000000000000000")
    assert code == 1 and "404" in err
    code, _, err = await _tandem(capsys, stack, "report", "ro_0000000000000000")
    assert code == 1 and "404" in err
    baseline = stack.versions[0].name
    code, _, err = await _tandem(
        capsys, stack, "start", ALIAS, "--baseline", baseline, "--candidate", f"{ALIAS}@ffffffff"
    )
    assert code == 1 and "400" in err and "ffffffff" in err
    code, _, err = await _tandem(capsys, stack, "start", ALIAS, "--candidate", baseline)
    assert code == 1 and "--baseline" in err


@pytest.mark.parametrize(
    ("gate", "why"),
    [
        ("ttft_p95", "needs max_value, max_ratio or both"),
        ("latency:max_ratio=2", "is not one of"),
        ("ttft_p95:max_ratio", "expected max_ratio=VALUE"),
        ("ttft_p95:max_ratio=fast", "is a number"),
        ("ttft_p95:max_ratio=2,samples=5", "unknown key 'samples'"),
        ("ttft_p95:max_ratio=2,min_samples=5.5", "whole number"),
    ],
)
def test_a_bad_gate_is_a_usage_error(
    gate: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["rollout", "start", ALIAS, "--baseline", "a", "--candidate", "b", "--gate", gate]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --gate" in err and why in err


def test_flags_become_the_spec_and_override_a_spec_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli.main import _parser
    from gateway.cli.rollouts import spec_body

    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "alias: other\nbaseline: smol@aaaaaaaa\ncandidate: smol@bbbbbbbb\nmode: ab\n"
        "steps: [{weight: 5}, {weight: 20}]\n"
        "gates: [{kind: error_rate, max_ratio: 2}, {kind: itl_p95, max_ratio: 1.2}]\n"
        "quality: {min_agreement: 0.9}\n"
    )
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"version": 1, "prompts": ["Say hi.", "Count to 3."]}))
    args = _parser().parse_args(
        [
            "rollout", "start", ALIAS, "--spec", str(spec), "--candidate", "smol@cccccccc",
            "--bake", "5m", "--interval", "30s", "--grace", "1h", "--keep-baseline",
            "--gate", "itl_p95:max_value=800ms,max_ratio=1.5,dry_run",
            "--quality-prompts", str(prompts), "--webhook", "https://ci.example/hook",
            "--webhook-secret", "s3cret", "--reason", "why not",
        ]
    )  # fmt: skip
    assert spec_body(args) == {
        "alias": ALIAS,
        "baseline": "smol@aaaaaaaa",
        "candidate": "smol@cccccccc",
        "mode": "ab",
        "steps": [{"weight": 5, "bake_s": 300.0}, {"weight": 20, "bake_s": 300.0}],
        "gates": [
            {"kind": "error_rate", "max_ratio": 2},
            {"kind": "itl_p95", "max_value": 0.8, "max_ratio": 1.5, "dry_run": True},
        ],
        "interval_s": 30.0,
        "grace_s": 3600.0,
        "drain_baseline": False,
        "quality": {"min_agreement": 0.9, "prompts": ["Say hi.", "Count to 3."]},
        "webhook": {"url": "https://ci.example/hook", "secret": "s3cret"},
        "reason": "why not",
    }
    args = _parser().parse_args(
        ["rollout", "start", ALIAS, "--baseline", "a", "--candidate", "b", "--steps", "1,5,100"]
    )
    body = spec_body(args)
    assert body["steps"] == [{"weight": w, "bake_s": 300.0} for w in (1.0, 5.0, 100.0)]
    assert "gates" not in body and "quality" not in body and "reason" not in body

    for bad in (["--bake", "5 minutes"], ["--no-quality", "--quality-prompts", str(prompts)]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["rollout", "start", ALIAS, *bad])
    assert "--bake" in capsys.readouterr().err


def _measurement(
    kind: str, verdict: str, ours: float | None, theirs: float | None, **gate: Any
) -> dict[str, Any]:
    return {
        "gate": {"kind": kind, "max_value": None, "max_ratio": None, "min_samples": 100,
                 "alpha": 0.05, "failure_limit": 1, "dry_run": False, **gate},
        "verdict": verdict, "candidate_value": ours, "baseline_value": theirs,
        "num_samples": 120, "baseline_samples": 130, "p_value": 0.0123 if ours else None,
        "detail": "",
    }  # fmt: skip


def _shown(renderable: Any) -> str:
    console = Console(record=True, width=200, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_the_screen_formats_each_figure_in_its_unit() -> None:
    now = 1_800_000_000.0
    history = [
        _measurement("ttft_p95", "inconclusive", 0.2, 0.19, max_ratio=1.1),
        _measurement("ttft_p95", "fail", 0.8123, 0.4, max_value=0.5, max_ratio=1.1),
        _measurement("error_rate", "pass", 0.015, 0.01, max_ratio=1.5),
        _measurement("busy_cost", "pass", 0.00012, 0.0001, max_ratio=1.5, dry_run=True),
        _measurement("output_length_drift", "pass", 42.0, 40.0, max_value=0.25),
        _measurement("finish_reason_drift", "pass", 0.032, None, max_value=0.1),
    ]
    spec_gates = [m["gate"] for m in history[1:]] + [{"kind": "itl_p95", "max_ratio": 1.1}]
    rollout = {
        "id": "ro_0123456789abcdef", "alias": "smol", "status": "paused", "phase": "canary",
        "created_at": now - 3600, "created_by": "admin", "reason": "",
        "weight": 25.0, "step": {"index": 2, "of": 4, "weight": 25.0, "bake_s": 300.0},
        "phase_ends_at": now + 125, "extensions": 1, "consecutive_errors": 0,
        "paused_reason": "still inconclusive [after 3 extensions]",
        "spec": {"baseline": "smol@aaaaaaaa", "candidate": "smol@bbbbbbbb", "mode": "canary",
                 "gates": spec_gates},
        "history": history, "quality": {"outcome": "pass", "agreement": 0.9,
                                        "min_agreement": 0.8, "prompts": [], "detail": ""},
        "decisions": [{"at": now - 60 * i, "event": f"event{i}", "detail": f"detail {i}",
                       "weight": 25.0, "actor": "rollout", "measurements": []}
                      for i in range(7, 0, -1)],
    }  # fmt: skip
    text = _shown(render(rollout, now))
    assert "smol@aaaaaaaa -> smol@bbbbbbbb, canary" in text
    assert "step 3/4" in text and "2m05s left (bake extended 1x)" in text
    assert "[after 3 extensions]" in text  # shown as written, not read as markup
    assert "pass, 90% agreed (min 80%)" in text
    lines = {line.split("│")[1].strip(): line for line in text.splitlines() if "│" in line}
    assert "812 ms" in lines["ttft_p95"] and "<= 500 ms, <= x1.1 baseline" in lines["ttft_p95"]
    assert "fail" in lines["ttft_p95"] and "120/130 (min 100)" in lines["ttft_p95"]
    assert "0.012" in lines["ttft_p95"]  # the p-value
    assert "1.5%" in lines["error_rate"] and "1.0%" in lines["error_rate"]
    assert "$0.000120/1k" in lines["busy_cost"] and "(dry run)" in lines["busy_cost"]
    assert "42.0 tok (+5.0%)" in lines["output_length_drift"]
    assert "drift <= 25%" in lines["output_length_drift"]
    assert "3.2%" in lines["finish_reason_drift"]
    assert "waiting" in lines["itl_p95"]  # not measured yet in this phase
    assert "event6" not in text and "event5" in text and "event1" in text  # the last five


def test_history_shows_the_decision_that_ended_each_rollout() -> None:
    rollout = {
        "id": "ro_1", "alias": "smol", "status": "failed", "created_at": 1_800_000_000.0,
        "spec": {"candidate": "smol@bbbbbbbb"},
        "decisions": [
            {"at": 1_800_000_100.0, "event": "failed", "detail": "failed: ttft_p95"},
            {"at": 1_800_000_100.0, "event": "rolled_back", "detail": "all traffic back"},
        ],
    }  # fmt: skip
    text = _shown(history_table([rollout]))
    assert "failed: failed: ttft_p95" in text and "2027-01-15 08:01:40Z" in text
