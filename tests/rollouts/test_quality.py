"""rollouts.quality: the tokens rule; one prompt's comparison (identical, terser, reworded,
garbage, empty sides); the set's thresholds; run_check against a fake engine per version
(agreement, garbage, engine failures, bounded concurrency); the shipped golden set; the settings'
validation and their JSON round trip."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from rollouts.quality import (
    MAX_PROMPTS,
    GoldenPrompt,
    PromptAgreement,
    QualityCheck,
    QualityResult,
    compare,
    default_prompts,
    judge,
    run_check,
    tokens,
)

CHECK = QualityCheck()
PARIS = "The capital of France is Paris."
# What SmolLM2-135M-Instruct in bf16 on vLLM's CPU build answered to "What is the capital of
# France?" (fp32 answers PARIS).
GARBAGE = "cTypesAndAnd ... ... ... AndAnd cTypes ... ... ..."


def user(content: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": content},)


def prompt(prompt_id: str, content: str = "What is the capital of France?") -> GoldenPrompt:
    return GoldenPrompt(prompt_id, user(content))


def agreement(prompt_id: str, agrees: bool, error: str | None = None) -> PromptAgreement:
    return PromptAgreement(prompt_id, "a", "b", agrees, 1.0 if agrees else 0.0, agrees, error)


class FakeEngines:
    """Answers per version from a table (prompt's last message -> answer), or raises what the
    table holds; counts the calls in flight."""

    def __init__(
        self,
        answers: Mapping[str, Mapping[str, str | Exception]],
        *,
        delay: float = 0.0,
    ) -> None:
        self.answers = answers
        self.delay = delay
        self.in_flight = 0
        self.max_in_flight = 0
        self.calls: list[tuple[str, str, int]] = []
        self.called = asyncio.Event()

    async def complete(
        self, version: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int
    ) -> str:
        question = messages[-1]["content"]
        self.calls.append((version, question, max_tokens))
        self.called.set()
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            answer = self.answers[version][question]
            if isinstance(answer, Exception):
                raise answer
            return answer
        finally:
            self.in_flight -= 1


QUESTIONS = {f"q{i}": f"Question {i}?" for i in range(10)}
GOOD = {
    question: f"The answer to question {i} is {i * 7}."
    for i, question in enumerate(QUESTIONS.values())
}
CHECK_10 = QualityCheck(prompts=tuple(prompt(pid, q) for pid, q in QUESTIONS.items()))


# --- tokens -------------------------------------------------------------------------------------


def test_tokens_are_lowercased_words_and_single_punctuation() -> None:
    assert tokens("The capital of France is Paris.") == [
        "the", "capital", "of", "france", "is", "paris", ".",
    ]  # fmt: skip
    assert tokens("Hello,   WORLD!!") == ["hello", ",", "world", "!", "!"]
    assert tokens("3 \u00d7 4 = 12; H2O") == ["3", "\u00d7", "4", "=", "12", ";", "h2o"]
    assert tokens("Je m'appelle\nÉlodie") == ["je", "m", "'", "appelle", "élodie"]
    assert tokens("snake_case ...") == ["snake_case", ".", ".", "."]
    assert tokens("") == []
    assert tokens(" \n\t ") == []


# --- compare -----------------------------------------------------------------------------------


def test_identical_answers_agree_fully() -> None:
    result = compare("capital-france", PARIS, PARIS, CHECK)
    assert result == PromptAgreement("capital-france", PARIS, PARIS, True, 1.0, True, None)


def test_spacing_and_case_do_not_matter() -> None:
    result = compare("p", PARIS, "the  capital of FRANCE is\nParis .", CHECK)
    assert result.prefix_match
    assert result.overlap == 1.0


def test_a_terser_answer_that_starts_the_same_way_agrees_on_the_prefix() -> None:
    baseline = (
        "A year is approximately 365 days, but in the Gregorian calendar, it's actually "
        "365.25 days. This is due to the fact that the Earth takes approximately 365.25 days to"
    )
    result = compare("months", baseline, "A year is approximately 365 days.", CHECK)
    # Its closing full stop is where the baseline goes on with ", but": not compared.
    assert result.prefix_match
    assert result.overlap < CHECK.min_overlap
    assert result.agrees


def test_a_late_divergence_agrees_on_the_prefix() -> None:
    # One token flipped on the 9th token, and greedy decoding follows it.
    baseline = (
        "The largest planet in our solar system is Jupiter, a gas giant with dozens of moons."
    )
    candidate = (
        "The largest planet in our solar system is Jupiter. It is made of hydrogen and helium."
    )
    result = compare("opposite-hot", baseline, candidate, CHECK)
    assert result.prefix_match
    assert result.agrees


def test_a_reworded_answer_agrees_on_overlap() -> None:
    result = compare("p", PARIS, "Paris is the capital of France.", CHECK)
    assert not result.prefix_match
    assert result.overlap == 1.0
    assert result.agrees


def test_overlap_is_token_f1() -> None:
    # Shared: the, answer, is (3); precision 3/4, recall 3/6: F1 = 2 * 0.75 * 0.5 / 1.25 = 0.6.
    result = compare("p", "So the answer is clearly 4", "The answer is 5", CHECK)
    assert not result.prefix_match
    assert result.overlap == pytest.approx(0.6)
    assert result.agrees
    # Bags, not sets: "no" twice on one side only counts once.
    assert compare("p", "no no", "no", CHECK).overlap == pytest.approx(2 * 1.0 * 0.5 / 1.5)


def test_below_min_overlap_without_a_prefix_match_disagrees() -> None:
    result = compare("p", "The sky is blue today", "Grass is green", CHECK)
    assert result.overlap == pytest.approx(2 * (1 / 3) * (1 / 5) / (1 / 3 + 1 / 5))
    assert not result.prefix_match
    assert not result.agrees


def test_garbage_does_not_agree_with_a_real_answer() -> None:
    result = compare("capital-france", PARIS, GARBAGE, CHECK)
    assert not result.prefix_match
    assert result.overlap == pytest.approx(2 / 28)  # the full stop, shared once
    assert not result.agrees
    # Not even against an answer that ends with a full stop like the garbage's dots.
    assert not compare("p", "Paris.", "...", CHECK).agrees


def test_empty_sides() -> None:
    both = compare("p", "", "  ", CHECK)
    assert (both.prefix_match, both.overlap, both.agrees) == (True, 1.0, True)
    for baseline, candidate in ((PARIS, ""), ("", PARIS)):
        one = compare("p", baseline, candidate, CHECK)
        assert (one.prefix_match, one.overlap, one.agrees) == (False, 0.0, False)


def test_prefix_tokens_and_min_overlap_are_the_checks() -> None:
    baseline = "one two three four five six seven eight nine ten"
    candidate = "one two three four five six seven EIGHTY x y z w"
    assert not compare("p", baseline, candidate, CHECK).prefix_match
    assert compare("p", baseline, candidate, QualityCheck(prefix_tokens=7)).prefix_match
    overlap = compare("p", baseline, candidate, CHECK).overlap
    assert overlap == pytest.approx(7 / 12 * 2 * 12 / 22)  # 7 shared of 12 and of 10
    assert compare("p", baseline, candidate, QualityCheck(min_overlap=overlap)).agrees
    assert not compare("p", baseline, candidate, QualityCheck(min_overlap=0.7)).agrees


# --- judge -------------------------------------------------------------------------------------


def test_exactly_at_min_agreement_passes() -> None:
    results = [agreement(f"p{i}", i < 8) for i in range(10)]
    result = judge(CHECK, results)
    assert result.outcome == "pass"
    assert result.agreement == 0.8
    assert result.min_agreement == 0.8
    assert result.prompts == tuple(results)
    assert "8 of 10" in result.detail
    assert "disagreed: p8, p9" in result.detail


def test_just_under_min_agreement_fails() -> None:
    result = judge(CHECK, [agreement(f"p{i}", i < 7) for i in range(10)])
    assert result.outcome == "fail"
    assert result.agreement == pytest.approx(0.7)
    assert "under the 80% minimum" in result.detail
    four_of_five = judge(
        QualityCheck(min_agreement=0.9), [agreement(f"p{i}", i < 4) for i in range(5)]
    )
    assert four_of_five.outcome == "fail"


def test_any_engine_error_is_an_error_outcome_naming_prompt_and_version() -> None:
    results = [agreement(f"p{i}", True) for i in range(9)]
    results.append(agreement("capital-france", False, "candidate: TimeoutError: no answer in 30 s"))
    result = judge(CHECK, results)
    assert result.outcome == "error"
    assert result.agreement == pytest.approx(0.9)  # the errored prompt does not agree
    assert "capital-france (candidate: TimeoutError: no answer in 30 s)" in result.detail


def test_judge_needs_a_result() -> None:
    with pytest.raises(ValueError, match="at least one prompt"):
        judge(CHECK, [])


def test_result_round_trips_through_json() -> None:
    results = [
        compare("a", PARIS, PARIS, CHECK),
        compare("b", PARIS, GARBAGE, CHECK),
        PromptAgreement("c", None, "x", False, 0.0, False, "baseline: OSError: refused"),
    ]
    result = judge(CHECK, results)
    assert QualityResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"outcome": "maybe"}, "outcome must be one of"),
        ({"agreement": "high"}, "agreement must be a number"),
        ({"min_agreement": 2}, "min_agreement must be a number"),
        ({"detail": None}, "detail must be a string"),
        ({"prompts": {}}, "prompts must be a list"),
        ({"prompts": [{"prompt_id": "a"}]}, r"prompts\[0\]: prompt agreement: prefix_match"),
    ],
)
def test_result_from_dict_names_the_bad_field(change: dict[str, Any], message: str) -> None:
    data = judge(CHECK, [compare("a", PARIS, PARIS, CHECK)]).to_dict() | change
    with pytest.raises(ValueError, match=message):
        QualityResult.from_dict(data)


# --- run_check ---------------------------------------------------------------------------------


async def test_identical_answers_pass() -> None:
    engines = FakeEngines({"v1": GOOD, "v2": GOOD})
    result = await run_check(CHECK_10, engines, "v1", "v2")
    assert result.outcome == "pass"
    assert result.agreement == 1.0
    assert [p.prompt_id for p in result.prompts] == list(QUESTIONS)
    assert all(p.baseline_text == p.candidate_text for p in result.prompts)
    # Every prompt on both versions, with the check's max_tokens.
    assert sorted(engines.calls) == sorted(
        (version, question, 48) for version in ("v1", "v2") for question in QUESTIONS.values()
    )


async def test_a_garbage_candidate_fails() -> None:
    garbage = dict.fromkeys(QUESTIONS.values(), GARBAGE)
    result = await run_check(CHECK_10, FakeEngines({"v1": GOOD, "v2": garbage}), "v1", "v2")
    assert result.outcome == "fail"
    assert result.agreement == 0.0
    assert all(p.candidate_text == GARBAGE and not p.agrees for p in result.prompts)


async def test_a_candidate_wrong_on_a_few_prompts_still_passes() -> None:
    mostly = dict(GOOD) | {"Question 0?": "I do not know.", "Question 1?": "No idea at all."}
    result = await run_check(CHECK_10, FakeEngines({"v1": GOOD, "v2": mostly}), "v1", "v2")
    assert result.outcome == "pass"
    assert result.agreement == 0.8


async def test_an_engine_failure_is_an_error_naming_prompt_and_version() -> None:
    failing: dict[str, str | Exception] = dict(GOOD)
    failing["Question 3?"] = ConnectionError("engine refused")
    engines = FakeEngines({"base": failing, "cand": GOOD})
    result = await run_check(CHECK_10, engines, "base", "cand")
    assert result.outcome == "error"
    [errored] = [p for p in result.prompts if p.error is not None]
    assert errored.prompt_id == "q3"
    assert errored.error == "baseline: ConnectionError: engine refused"
    assert errored.baseline_text is None
    assert errored.candidate_text == GOOD["Question 3?"]
    assert "q3 (baseline: ConnectionError: engine refused)" in result.detail

    both: dict[str, str | Exception] = dict(GOOD) | {"Question 3?": RuntimeError("boom")}
    result = await run_check(CHECK_10, FakeEngines({"base": failing, "cand": both}), "base", "cand")
    [errored] = [p for p in result.prompts if p.error is not None]
    assert errored.error == (
        "baseline: ConnectionError: engine refused; candidate: RuntimeError: boom"
    )


async def test_concurrency_is_bounded() -> None:
    engines = FakeEngines({"v1": GOOD, "v2": GOOD}, delay=0.01)
    await run_check(CHECK_10, engines, "v1", "v2", concurrency=3)
    assert engines.max_in_flight == 3
    assert len(engines.calls) == 20
    engines = FakeEngines({"v1": GOOD, "v2": GOOD}, delay=0.01)
    await run_check(CHECK_10, engines, "v1", "v2", concurrency=1)
    assert engines.max_in_flight == 1


async def test_cancellation_cancels_the_calls_in_flight() -> None:
    engines = FakeEngines({"v1": GOOD, "v2": GOOD}, delay=60)
    task = asyncio.create_task(run_check(CHECK_10, engines, "v1", "v2"))
    await asyncio.wait_for(engines.called.wait(), timeout=5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engines.in_flight == 0


async def test_the_default_set_runs_when_the_check_names_none() -> None:
    questions = {p.messages[-1]["content"]: p.id for p in default_prompts()}
    answers = {question: f"Answer to {prompt_id}." for question, prompt_id in questions.items()}
    engines = FakeEngines({"v1": answers, "v2": answers})
    result = await run_check(QualityCheck(), engines, "v1", "v2")
    assert result.outcome == "pass"
    assert [p.prompt_id for p in result.prompts] == [p.id for p in default_prompts()]


async def test_run_check_refuses_a_concurrency_below_one() -> None:
    with pytest.raises(ValueError, match="concurrency"):
        await run_check(CHECK_10, FakeEngines({}), "v1", "v2", concurrency=0)


# --- the shipped set ---------------------------------------------------------------------------


def test_default_prompts_load_with_unique_ids() -> None:
    prompts = default_prompts()
    assert 16 <= len(prompts) <= 24
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.messages[-1]["role"] == "user" for p in prompts)
    assert default_prompts() is prompts  # read once
    assert "What is the capital of France?" in {p.messages[-1]["content"] for p in prompts}


# --- settings ----------------------------------------------------------------------------------


def test_check_round_trips_through_json() -> None:
    check = QualityCheck(
        prompts=(
            GoldenPrompt(
                "terse",
                (
                    {"role": "system", "content": "Answer in one word."},
                    {"role": "user", "content": "Capital of Japan?"},
                ),
            ),
            prompt("france"),
        ),
        prefix_tokens=5,
        min_overlap=0.4,
        min_agreement=0.9,
        max_tokens=32,
        enabled=False,
    )
    assert QualityCheck.from_dict(json.loads(json.dumps(check.to_dict()))) == check
    assert QualityCheck.from_dict(CHECK.to_dict()) == CHECK
    assert QualityCheck.from_dict({}) == CHECK


def test_plain_string_prompts_are_one_user_message_each() -> None:
    check = QualityCheck.from_dict(
        {"prompts": ["What is 2 + 2?", {"id": "sky", "messages": list(user("Sky color?"))}]}
    )
    assert check.prompts == (
        GoldenPrompt("prompt-1", user("What is 2 + 2?")),
        GoldenPrompt("sky", user("Sky color?")),
    )


def test_a_prompt_keeps_its_own_copy_of_the_messages() -> None:
    message = {"role": "user", "content": "What is 2 + 2?"}
    golden = GoldenPrompt("p", (message,))
    message["content"] = "changed"
    assert golden.messages[0]["content"] == "What is 2 + 2?"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prefix_tokens": 0}, "prefix_tokens must be an integer of at least 1"),
        ({"prefix_tokens": 2.5}, "prefix_tokens"),
        ({"prefix_tokens": True}, "prefix_tokens"),
        ({"min_overlap": 0}, "min_overlap must be a share"),
        ({"min_overlap": 1.5}, "min_overlap"),
        ({"min_overlap": float("nan")}, "min_overlap"),
        ({"min_agreement": -0.1}, "min_agreement must be a share"),
        ({"min_agreement": "0.8"}, "min_agreement"),
        ({"max_tokens": 0}, "max_tokens must be an integer from 1 to 1024"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"enabled": "yes"}, "enabled must be true or false"),
        ({"prompts": "What is 2 + 2?"}, "prompts: expected a list"),
        ({"prompts": []}, "prompts must number 1 to 200"),
        ({"prompts": ["ok?"] * (MAX_PROMPTS + 1)}, "at most 200"),
        ({"prompts": ["ok?", ""]}, r"prompts\[1\]: an empty prompt"),
        ({"prompts": [42]}, r"prompts\[0\]: expected a string or an object"),
        ({"prompts": [{"id": "a"}]}, r"prompts\[0\]: expected exactly the fields"),
        ({"prompts": [{"id": "a", "messages": "hi"}]}, r"prompts\[0\]\.messages: expected a list"),
        ({"prompts": [{"id": "", "messages": [{"role": "user", "content": "hi"}]}]}, "id must be"),
        (
            {"prompts": [{"id": "a", "messages": [{"role": "robot", "content": "hi"}]}]},
            r"messages\[0\]\.role 'robot' is not one of",
        ),
        (
            {"prompts": [{"id": "a", "messages": [{"role": "user"}]}]},
            r"messages\[0\] must be \{'role': str, 'content': str\}",
        ),
        (
            {"prompts": [{"id": "a", "messages": [{"role": "assistant", "content": "hi"}]}]},
            "the last message must be the user's",
        ),
        (
            {
                "prompts": [
                    "one?",
                    {"id": "prompt-1", "messages": [{"role": "user", "content": "x"}]},
                ]
            },
            "'prompt-1' is used twice",
        ),
        ({"min_agreemnt": 0.9}, "unknown field.*'min_agreemnt'"),
    ],
)
def test_from_dict_names_the_bad_field(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QualityCheck.from_dict(settings)


def test_the_constructor_validates_prompts_too() -> None:
    with pytest.raises(ValueError, match="'a' is used twice"):
        QualityCheck(prompts=(prompt("a"), prompt("a")))
    with pytest.raises(ValueError, match="tuple of GoldenPrompt"):
        QualityCheck(prompts=[prompt("a")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-empty tuple"):
        GoldenPrompt("a", ())
