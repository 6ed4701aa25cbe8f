"""``tandem bench`` as users run it: the console entry point against a fake vLLM server in its
own process, writing JSON, CSV and plots, comparing runs and exporting prompts for vLLM."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness.result import RunResult
from tandem.cli import main
from tests.bench.tokenizer import trained_tokenizer


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.fake_engine", "--output-tokens", "6",
         "--token-delay-s", "0.002"],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.startswith("FAKE_ENGINE_READY"), line
        yield line.split()[1]
    finally:
        child.terminate()
        child.wait(timeout=10)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    trained_tokenizer().save(str(path))
    return path


def bench(*args: str | Path) -> int:
    return main(["bench", *map(str, args)])


def test_run_writes_json_csv_and_plots(
    engine_url: str, tokenizer_file: Path, tmp_path: Path
) -> None:
    code = bench(
        "run", "--base-url", engine_url, "--tokenizer", tokenizer_file, "--no-token-check",
        "--rate", "40", "--arrival", "gamma", "--burstiness", "0.5", "--num-requests", "12",
        "--warmup", "2", "--input-len", "normal:30:5", "--output-len", "fixed:4",
        "--slo", "ttft:2000", "--label", "smoke", "--no-progress",
        "--out-json", tmp_path / "a.json", "--out-csv", tmp_path / "a.csv",
        "--plots", tmp_path / "plots",
    )  # fmt: skip
    assert code == 0
    result = RunResult.load_json(tmp_path / "a.json")
    assert result.label == "smoke" and result.config["target"]["model"] == "fake-model"
    assert result.summary.completed == 12 and result.summary.good == 12
    assert result.config["shape"]["arrival"] == "gamma"
    rows = list(csv.DictReader((tmp_path / "a.csv").open()))
    assert len(rows) == 14 and rows[0]["warmup"] == "True"
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"ttft_cdf.png", "itl_cdf.png"}


def test_compare_two_runs(engine_url: str, tokenizer_file: Path, tmp_path: Path) -> None:
    for name, concurrency in (("a", "1"), ("b", "4")):
        assert bench(
            "run", "--base-url", engine_url, "--tokenizer", tokenizer_file, "--no-token-check",
            "--concurrency", concurrency, "--num-requests", "8", "--no-progress",
            "--out-json", tmp_path / f"{name}.json",
        ) == 0  # fmt: skip
    assert bench("compare", tmp_path / "a.json", tmp_path / "b.json") == 0
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert bench("compare", tmp_path / "a.json", tmp_path / "junk.json") == 2


def test_multi_tenant_file(engine_url: str, tokenizer_file: Path, tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.json"
    tenants.write_text(
        json.dumps(
            [
                {"name": "chat", "share": 2, "priority": "high", "output_len": "fixed:3"},
                {"name": "batch", "share": 1, "input_len": "fixed:60"},
            ]
        )
    )
    assert bench(
        "run", "--base-url", engine_url, "--tokenizer", tokenizer_file, "--no-token-check",
        "--tenants", tenants, "--concurrency", "3", "--num-requests", "15", "--no-progress",
        "--out-json", tmp_path / "t.json",
    ) == 0  # fmt: skip
    result = RunResult.load_json(tmp_path / "t.json")
    assert set(result.tenants) == {"chat", "batch"}
    assert {t["name"]: t["priority"] for t in result.config["tenants"]}["chat"] == "high"
    chat = [r for r in result.records if r.tenant == "chat"]
    assert chat and all(r.max_tokens == 3 for r in chat)


def test_dataset_export_for_vllm(tokenizer_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "prompts.jsonl"
    assert bench("dataset", "--tokenizer", tokenizer_file, "--num-requests", "5", "--out", out) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 5 and all(set(line) == {"prompt", "output_tokens"} for line in lines)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "2", "--rate", "3"], "not both"),
        ([], "give a load"),
        (["--concurrency", "2", "--input-len", "zipf:3"], "zipf:3"),
        (["--concurrency", "2", "--slo", "ttft"], "NAME:MILLISECONDS"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    engine_url: str,
    tokenizer_file: Path,
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = bench("run", "--base-url", engine_url, "--tokenizer", tokenizer_file, *args)
    assert code == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


def test_an_unreachable_server_is_a_clear_error(
    tokenizer_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = bench("run", "--base-url", "http://127.0.0.1:9", "--tokenizer", tokenizer_file,
                 "--concurrency", "1")  # fmt: skip
    assert code == 2 and "cannot reach http://127.0.0.1:9/v1/models" in capsys.readouterr().err
