"""``bench.overhead.scaling``: where each part of the run is pinned, and what one load
generator counts, against the fake engine in this process."""

from __future__ import annotations

import time

import pytest

from bench.overhead.fake_vllm import FakeVllm
from bench.overhead.scaling import Layout
from bench.overhead.scaling_load import LoadArgs, parse, run

MODEL = "fake-model"  # the ``fake`` fixture's (tests/bench/conftest.py)
TOKENS = 4


def test_layout_gives_every_part_cores_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    layout = Layout.plan(max_processes=4, engines=3, generators=5, pin=True)
    assert [len(cores or ()) for cores in layout.gateway] == [1, 2, 3, 4]
    widest = layout.gateway[-1] or frozenset()
    others = [*layout.engines, *layout.generators, layout.rest]
    taken = [core for cores in others for core in cores or ()]
    assert len(taken) == len(set(taken)), "a core is given twice"
    assert not widest & set(taken), "the gateway shares a core with the load"
    assert len(layout.engines) == 3 and len(layout.generators) == 5
    assert layout.rest == frozenset(range(12, 16))


def test_a_redis_core_is_one_no_other_part_has(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    layout = Layout.plan(max_processes=4, engines=3, generators=5, pin=True, redis_core=True)
    assert layout.redis == frozenset({4})
    parts = [layout.gateway[-1], *layout.engines, *layout.generators, layout.rest]
    assert not any(4 in (cores or ()) for cores in parts)
    assert layout.rest == frozenset(range(13, 16))
    assert Layout.plan(max_processes=4, engines=3, generators=5, pin=True).redis is None


def test_layout_refuses_a_machine_too_small_naming_the_way_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    with pytest.raises(SystemExit, match=r"needs 5 cores .* 2 are available.*--no-pin"):
        Layout.plan(max_processes=2, engines=1, generators=1, pin=True)
    unpinned = Layout.plan(max_processes=2, engines=1, generators=1, pin=False)
    assert unpinned.gateway == [None, None] and unpinned.rest is None


async def test_a_generator_counts_the_streams_that_end_inside_its_window(
    fake: tuple[FakeVllm, str],
) -> None:
    engine, url = fake
    assert engine.timing.num_tokens == TOKENS
    args = LoadArgs(
        url=url, api_key=None, model=MODEL, concurrency=3, start_at=time.time(),
        warmup_s=0.3, duration_s=0.7, tokens=TOKENS, prompt_words=5, stagger_s=0.01,
    )  # fmt: skip
    report = await run(args)
    assert report.failed == 0 and report.errors == {}
    assert report.completed > 0
    # Every stream carries one event per token and one with the finish reason and usage.
    assert report.chunks == report.completed * (TOKENS + 1)
    # Streams ended in the warm-up (and any still open at the end) are sent but not counted.
    assert engine.stats.streams > report.completed
    assert report.window_s == 0.7 and report.generator_cpu_s > 0


async def test_a_generator_counts_refusals_as_failures_by_kind(
    fake: tuple[FakeVllm, str],
) -> None:
    _, url = fake
    args = LoadArgs(
        url=url, api_key=None, model="no-such-model", concurrency=2, start_at=time.time(),
        warmup_s=0.0, duration_s=0.3, tokens=TOKENS, prompt_words=5, stagger_s=0.01,
    )  # fmt: skip
    report = await run(args)
    assert report.completed == 0 and report.failed > 0
    assert set(report.errors) == {"http_404"}


def test_a_generators_command_line_reads_back_as_its_settings() -> None:
    full = LoadArgs(
        url="http://127.0.0.1:1", api_key="tdm-key", model=MODEL, concurrency=7, start_at=12.5,
        warmup_s=0.0, duration_s=3.25, tokens=8, prompt_words=9, stagger_s=0.0,
    )  # fmt: skip
    keyless = LoadArgs("http://127.0.0.1:1", None, MODEL, 2, 1.0)  # parse's defaults
    for args in (full, keyless):
        argv = args.command()
        assert argv[1:3] == ["-m", "bench.overhead.scaling_load"]
        assert parse(argv[3:]) == args
    assert "--api-key" not in keyless.command()
