"""The harness's prompt sets: length distributions, exact-length synthetic prompts, the shipped
chat set, and the file handed to ``vllm bench serve``.

Token counts are checked with a byte-level BPE trained here on the shipped prompts (the same
family as the served model's tokenizer, and there on every machine: CI does not prepare the
model before the fast tiers), and also with the bundled model's own tokenizer where it has been
prepared.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

import bench.harness.dataset as dataset
from bench.harness.dataset import (
    DatasetError,
    LengthDistribution,
    Prompt,
    chat_prompts,
    describe_tokens,
    load_tokenizer,
    synthetic_prompts,
    write_vllm_custom_jsonl,
)
from tests.bench.tokenizer import SHIPPED, trained_tokenizer
from workers.model import find_prepared

SPECS = ["fixed:128", "uniform:64:256", "normal:128:32", "lognormal:128:0.5"]
# The bundled tokenizer joins in only where the model is prepared: a test id that exists or
# not, never a skip.
TOKENIZERS = ["trained"] + (["bundled"] if find_prepared() is not None else [])


@pytest.fixture(scope="module", params=TOKENIZERS)
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return trained_tokenizer() if request.param == "trained" else load_tokenizer(None)


def count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def fixed(n: int) -> LengthDistribution:
    return LengthDistribution.parse(f"fixed:{n}")


def test_public_exports() -> None:
    assert dataset.__all__ == [
        "DatasetError",
        "LengthDistribution",
        "Prompt",
        "chat_prompts",
        "describe_tokens",
        "load_tokenizer",
        "synthetic_prompts",
        "write_vllm_custom_jsonl",
    ]


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trips_and_samples_ints_deterministically(spec: str) -> None:
    distribution = LengthDistribution.parse(spec)
    assert distribution.describe() == spec
    first = distribution.sample(np.random.default_rng(5), 1000)
    assert first == distribution.sample(np.random.default_rng(5), 1000)
    assert all(type(length) is int and length >= 1 for length in first)
    if spec != "fixed:128":
        assert first != distribution.sample(np.random.default_rng(6), 1000)


def test_samples_follow_their_distribution() -> None:
    rng = np.random.default_rng(0)
    assert LengthDistribution.parse("fixed:128").sample(rng, 50) == [128] * 50
    assert set(LengthDistribution.parse("uniform:1:3").sample(rng, 3000)) == {1, 2, 3}
    uniform = LengthDistribution.parse("uniform:64:256").sample(rng, 3000)
    assert min(uniform) >= 64 and max(uniform) <= 256
    normal = np.array(LengthDistribution.parse("normal:128:32").sample(rng, 20000))
    assert abs(normal.mean() - 128) < 1.5 and abs(normal.std() - 32) < 1.5
    lognormal = np.array(LengthDistribution.parse("lognormal:128:0.5").sample(rng, 20000))
    assert abs(np.median(lognormal) - 128) < 4
    assert abs(np.log(lognormal).std() - 0.5) < 0.02
    clipped = LengthDistribution.parse("normal:2:10").sample(rng, 2000)
    assert min(clipped) == 1
    assert LengthDistribution.parse("uniform:7:7").sample(rng, 0) == []


def test_describe_keeps_fractions() -> None:
    assert LengthDistribution.parse("normal:100.5:7.25").describe() == "normal:100.5:7.25"
    assert LengthDistribution.parse(" fixed:64 ").describe() == "fixed:64"


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "128",
        "fixed",
        "fixed:",
        "fixed:0",
        "fixed:-3",
        "fixed:1.5",
        "fixed:abc",
        "fixed:128:1",
        "uniform:10:5",
        "uniform:0:5",
        "uniform:5",
        "normal:128",
        "normal:128:0",
        "normal:nan:1",
        "lognormal:0:1",
        "lognormal:128:-1",
        "lognormal:inf:1",
        "poisson:3",
    ],
)
def test_bad_spec_names_itself_and_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError, match="lognormal:MEDIAN:SIGMA") as error:
        LengthDistribution.parse(spec)
    assert repr(spec) in str(error.value)


def test_direct_construction_is_checked_too() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        LengthDistribution("normal", (128.0, 0.0))
    with pytest.raises(ValueError, match="whole numbers"):
        LengthDistribution("fixed", (2.5,))


def test_synthetic_prompts_have_exactly_the_drawn_lengths(tokenizer: Tokenizer) -> None:
    rng = np.random.default_rng(11)
    prompts = synthetic_prompts(
        tokenizer, rng, 200, LengthDistribution.parse("lognormal:128:1.0"), fixed(32)
    )
    prompts += synthetic_prompts(
        tokenizer, rng, 60, LengthDistribution.parse("uniform:1:5"), fixed(8)
    )
    prompts += synthetic_prompts(tokenizer, rng, 4, fixed(2000), fixed(8))
    for prompt in prompts:
        assert count(tokenizer, prompt.text) == prompt.tokens, prompt
        assert prompt.prefix_group is None
    lengths = {prompt.tokens for prompt in prompts}
    assert {1, 2, 3, 4, 5, 2000} <= lengths
    assert len(lengths) > 100  # the lognormal draws came through, not a few fixed lengths
    assert [prompt.output_tokens for prompt in prompts] == [32] * 200 + [8] * 64


def test_synthetic_prompts_differ_from_their_first_tokens(tokenizer: Tokenizer) -> None:
    # A prefix cache matches from the first token on: distinct openings mean no free hits.
    prompts = synthetic_prompts(
        tokenizer,
        np.random.default_rng(3),
        200,
        LengthDistribution.parse("lognormal:128:0.5"),
        fixed(16),
    )
    openings = [tuple(tokenizer.encode(p.text, add_special_tokens=False).ids[:16]) for p in prompts]
    assert len(set(openings)) == len(prompts)
    assert all(prompt.text == prompt.text.strip() for prompt in prompts)


def test_synthetic_prompts_are_fixed_by_the_seed(tokenizer: Tokenizer) -> None:
    def make(seed: int) -> list[Prompt]:
        rng = np.random.default_rng(seed)
        return synthetic_prompts(
            tokenizer, rng, 30, LengthDistribution.parse("normal:64:16"), fixed(4)
        )

    assert make(1) == make(1)
    assert [p.text for p in make(1)] != [p.text for p in make(2)]


def test_shared_prefix_prompts_share_exact_prefixes(tokenizer: Tokenizer) -> None:
    prefix_tokens, groups = 64, 3
    prompts = synthetic_prompts(
        tokenizer,
        np.random.default_rng(8),
        30,
        LengthDistribution.parse("uniform:1:40"),
        fixed(16),
        shared_prefix_tokens=prefix_tokens,
        prefix_groups=groups,
    )
    assert [p.prefix_group for p in prompts] == [i % groups for i in range(30)]
    for prompt in prompts:
        assert count(tokenizer, prompt.text) == prompt.tokens
        assert prefix_tokens + 1 <= prompt.tokens <= prefix_tokens + 40
    openings = set()
    for group in range(groups):
        texts = [p.text for p in prompts if p.prefix_group == group]
        shared = os.path.commonprefix(texts)  # noqa: RUF071 (strings, not paths)
        assert count(tokenizer, shared) >= prefix_tokens  # the same text, not just similar
        ids = {
            tuple(tokenizer.encode(t, add_special_tokens=False).ids[:prefix_tokens]) for t in texts
        }
        assert len(ids) == 1  # and the same tokens, which is what the server's cache matches
        openings |= ids
        assert len(set(texts)) == len(texts)
    assert len(openings) == groups


def test_suffix_length_is_drawn_from_input_len(tokenizer: Tokenizer) -> None:
    prompts = synthetic_prompts(
        tokenizer,
        np.random.default_rng(2),
        12,
        fixed(10),
        fixed(4),
        shared_prefix_tokens=5,
        prefix_groups=2,
    )
    assert all(p.tokens == 15 == count(tokenizer, p.text) for p in prompts)


def test_synthetic_arguments_are_checked(tokenizer: Tokenizer) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="prefix_groups"):
        synthetic_prompts(tokenizer, rng, 3, fixed(8), fixed(8), prefix_groups=0)
    with pytest.raises(ValueError, match="shared_prefix_tokens"):
        synthetic_prompts(tokenizer, rng, 3, fixed(8), fixed(8), shared_prefix_tokens=-1)


def test_shipped_chat_prompts_are_many_and_varied(tokenizer: Tokenizer) -> None:
    assert len(SHIPPED) >= 50
    assert len(set(SHIPPED)) == len(SHIPPED)
    lengths = [count(tokenizer, text) for text in SHIPPED]
    assert min(lengths) <= 15 and max(lengths) >= 250


def test_chat_prompts_are_drawn_from_the_shipped_set(tokenizer: Tokenizer) -> None:
    output_len = LengthDistribution.parse("uniform:16:64")
    prompts = chat_prompts(tokenizer, np.random.default_rng(4), 300, output_len)
    assert len(prompts) == 300
    for prompt in prompts:
        assert prompt.text in SHIPPED
        assert prompt.tokens == count(tokenizer, prompt.text)
        assert 16 <= prompt.output_tokens <= 64 and prompt.prefix_group is None
    assert len({p.text for p in prompts}) > len(SHIPPED) // 2  # with replacement, all over
    assert prompts == chat_prompts(tokenizer, np.random.default_rng(4), 300, output_len)
    other = chat_prompts(tokenizer, np.random.default_rng(5), 300, output_len)
    assert [p.text for p in other] != [p.text for p in prompts]


def test_vllm_custom_jsonl_round_trips(tmp_path: Path) -> None:
    prompts = [
        Prompt('two lines\nwith "quotes"', 7, 128, None),
        Prompt("caf\u00e9 \u2014 \u65e5\u672c", 5, 1, 0),
    ]
    path = tmp_path / "custom.jsonl"
    write_vllm_custom_jsonl(prompts, path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [
        {"prompt": 'two lines\nwith "quotes"', "output_tokens": 128},
        {"prompt": "caf\u00e9 \u2014 \u65e5\u672c", "output_tokens": 1},
    ]


def test_describe_tokens() -> None:
    prompts = [Prompt("a", 10, 5, None), Prompt("b", 30, 7, None), Prompt("c", 20, 3, None)]
    assert describe_tokens(prompts) == {
        "count": 3,
        "input_tokens_total": 60,
        "input_tokens_mean": 20.0,
        "input_tokens_min": 10,
        "input_tokens_max": 30,
        "output_tokens_total": 15,
    }
    assert describe_tokens([])["count"] == 0


def test_load_tokenizer_from_a_file_or_its_folder(tmp_path: Path) -> None:
    trained_tokenizer().save(str(tmp_path / "tokenizer.json"))
    text = SHIPPED[0]
    expected = trained_tokenizer().encode(text).ids
    assert load_tokenizer(tmp_path).encode(text).ids == expected
    assert load_tokenizer(str(tmp_path / "tokenizer.json")).encode(text).ids == expected


def test_load_tokenizer_says_what_to_do_when_nothing_is_there(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as error:
        load_tokenizer(tmp_path)
    message = str(error.value)
    assert str(tmp_path / "tokenizer.json") in message
    assert "tandem model prepare" in message and "--tokenizer" in message


def test_load_tokenizer_rejects_a_broken_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"not a usable tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_load_tokenizer_without_a_prepared_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # an empty model cache
    with pytest.raises(DatasetError) as error:
        load_tokenizer(None)
    assert "--tokenizer" in str(error.value)
