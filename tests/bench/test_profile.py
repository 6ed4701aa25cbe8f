"""``tandem profile`` against a fake worker whose timings are known: prefill throughput by
prompt length from the time to the first token, decode ITL by concurrency, the JSON file the
planner loads, and a failed measurement named instead of saved."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.profile import ProfileRunError, ProfileSpec, measure
from planner.profile import Profile
from tandem.cli import main
from tests.bench.tokenizer import trained_tokenizer
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.conftest import MODEL

VERSION = "smol@1234abcd"
FIRST_TOKEN_S, TOKEN_S = 0.05, 0.01


async def test_a_profile_is_prefill_by_length_and_decode_by_concurrency() -> None:
    async with FakeEngine(MODEL, output_tokens=100) as engine:
        engine.first_token_delay_s, engine.token_delay_s = FIRST_TOKEN_S, TOKEN_S
        spec = ProfileSpec(
            engine.base_url,
            MODEL,
            VERSION,
            prompt_lengths=(64, 16),
            concurrency=(2, 1),
            prefill_requests=2,
            output_len=6,
        )
        profile = await measure(spec, trained_tokenizer())
        # One warm-up and two measured requests per length; per concurrency c, c warm-ups
        # and 2c measured streams.
        assert engine.stats.num_requests == 2 * 3 + (1 + 2) + (2 + 4)

    assert profile.version == VERSION
    assert [p.prompt_tokens for p in profile.prefill] == [16, 64]  # sorted
    for point in profile.prefill:
        # The fake's prefill is its first-token delay: never faster than length / delay.
        ceiling = point.prompt_tokens / FIRST_TOKEN_S
        assert ceiling / 4 < point.tokens_per_s <= ceiling
    assert [d.concurrency for d in profile.decode] == [1, 2]
    for decode in profile.decode:
        # Each token waits the fake's delay; chunks that arrive together shorten a gap or two.
        assert TOKEN_S / 2 < decode.itl_s < 4 * TOKEN_S


async def test_a_failing_worker_names_the_point_and_saves_nothing(tmp_path: Path) -> None:
    async with FakeEngine(MODEL) as engine:
        engine.fail_status = 500
        spec = ProfileSpec(engine.base_url, MODEL, VERSION, prompt_lengths=(16,))
        with pytest.raises(
            ProfileRunError, match="profile 16x1 at 1: 4 failed and 0 malformed of 4"
        ):
            await measure(spec, trained_tokenizer())


async def test_tandem_profile_writes_the_file_the_planner_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    trained_tokenizer().save(str(tokenizer))
    out = tmp_path / "profiles" / "smol.json"
    async with FakeEngine(MODEL, output_tokens=100) as engine:
        engine.token_delay_s = 0.002
        argv = [
            "profile", "--base-url", engine.base_url, "--version", VERSION,
            "--tokenizer", str(tokenizer), "--out", str(out), "--prompt-lens", "8,32",
            "--concurrency", "1,3", "--prefill-requests", "1", "--output-len", "4",
        ]  # fmt: skip
        code = await asyncio.to_thread(main, argv)
    assert code == 0, capsys.readouterr().err
    profile = Profile.load(out)
    assert profile.version == VERSION
    assert [p.prompt_tokens for p in profile.prefill] == [8, 32]
    assert [d.concurrency for d in profile.decode] == [1, 3]
    assert json.loads(out.read_text())["format"] == 1
    assert "worker profile of smol@1234abcd" in capsys.readouterr().out


def test_bad_points_are_refused_by_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--base-url", "http://127.0.0.1:9", "--out", "p.json",
              "--concurrency", "4,0"])  # fmt: skip
    assert "whole numbers >= 1" in capsys.readouterr().err
