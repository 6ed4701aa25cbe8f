"""Moderator: input verdicts, provider merging, concurrency, lifecycle, policy checks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import MappingProxyType

import pytest

from core.errors import ModerationUnavailableError
from core.moderation import Action, Category, ModerationPolicy, Stage, StagePolicy
from moderation.hits import Hit, TextResult, result_of
from moderation.moderator import Moderator
from moderation.rules import RuleSet, RulesProvider
from moderation.stream import StreamConfig

RULES = RulesProvider(
    RuleSet.from_dict({"terms": {"violence": ["i will hurt you"]}, "pii": ["email", "phone"]})
)


def stage(*providers: str, **actions: Action) -> StagePolicy:
    return StagePolicy(providers, MappingProxyType(dict(actions)))


class FakeProvider:
    """Scores every text with fixed whole-text hits; counts lifecycle calls."""

    def __init__(self, name: str, hits: Sequence[tuple[Category, float]] = ()) -> None:
        self.name = name
        self.hits = hits
        self.started = 0
        self.closed = 0

    async def start(self) -> None:
        self.started += 1

    async def aclose(self) -> None:
        self.closed += 1

    async def check(self, texts: Sequence[str]) -> list[TextResult]:
        return [result_of(Hit(c, self.name, None, None, s) for c, s in self.hits) for _ in texts]


async def test_redacts_pii_and_records_decisions() -> None:
    mod = Moderator({"rules": RULES}, StreamConfig())
    verdict = await mod.check_input(
        stage("rules", pii=Action.REDACT, violence=Action.FLAG),
        ["mail me at a@example.com or +44 20 7946 0958", "i will hurt you"],
    )
    assert not verdict.blocked
    assert verdict.texts == ("mail me at [REDACTED:email] or [REDACTED:phone]", "i will hurt you")
    assert [(d.stage, d.category, d.action, d.detector) for d in verdict.decisions] == [
        (Stage.INPUT, Category.PII, Action.REDACT, "email"),
        (Stage.INPUT, Category.PII, Action.REDACT, "phone"),
        (Stage.INPUT, Category.VIOLENCE, Action.FLAG, "terms"),
    ]


async def test_block_names_the_categories() -> None:
    mod = Moderator({"rules": RULES}, StreamConfig())
    verdict = await mod.check_input(
        stage("rules", **{"*": Action.BLOCK}), ["hi a@example.com", "i will hurt you"]
    )
    assert verdict.blocked
    assert verdict.blocked_categories == (Category.PII, Category.VIOLENCE)


async def test_whole_text_redact_blocks() -> None:
    remote = FakeProvider("remote", [(Category.HATE, 0.9)])
    mod = Moderator({"remote": remote}, StreamConfig())
    verdict = await mod.check_input(stage("remote", hate=Action.REDACT), ["text"])
    assert verdict.blocked
    assert [d.action for d in verdict.decisions] == [Action.BLOCK]


async def test_disabled_policy_checks_nothing() -> None:
    mod = Moderator({"rules": RULES}, StreamConfig())
    verdict = await mod.check_input(stage("rules"), ["i will hurt you"])
    assert verdict == type(verdict)(False, ("i will hurt you",), (), ())


async def test_classify_merges_providers() -> None:
    a = FakeProvider("a", [(Category.HATE, 0.4), (Category.VIOLENCE, 0.9)])
    b = FakeProvider("b", [(Category.HATE, 0.7)])
    mod = Moderator({"a": a, "b": b}, StreamConfig())
    (result,) = await mod.classify(["x"], ["a", "b"])
    assert result.scores[Category.HATE] == 0.7
    assert result.scores[Category.VIOLENCE] == 0.9
    assert sorted((h.provider, h.category.value) for h in result.hits) == [
        ("a", "hate"),
        ("a", "violence"),
        ("b", "hate"),
    ]


async def test_providers_run_concurrently() -> None:
    ready = asyncio.Event()

    class Waits(FakeProvider):
        async def check(self, texts: Sequence[str]) -> list[TextResult]:
            await ready.wait()  # only the other provider, running at the same time, sets it
            return await super().check(texts)

    class Sets(FakeProvider):
        async def check(self, texts: Sequence[str]) -> list[TextResult]:
            ready.set()
            return await super().check(texts)

    mod = Moderator({"w": Waits("w"), "s": Sets("s")}, StreamConfig())
    verdict = await asyncio.wait_for(
        mod.check_input(stage("w", "s", hate=Action.BLOCK), ["x"]), timeout=2
    )
    assert not verdict.blocked


async def test_a_fail_closed_provider_error_is_raised_as_is() -> None:
    class Down(FakeProvider):
        async def check(self, texts: Sequence[str]) -> list[TextResult]:
            raise ModerationUnavailableError("moderation provider 'down' failed")

    mod = Moderator({"rules": RULES, "down": Down("down")}, StreamConfig())
    with pytest.raises(ModerationUnavailableError, match="'down'"):
        await mod.check_input(stage("rules", "down", hate=Action.BLOCK), ["x"])


async def test_output_stream_uses_the_policy_providers() -> None:
    mod = Moderator({"rules": RULES}, StreamConfig())
    stream = mod.output_stream(stage("rules", violence=Action.BLOCK))
    first = await stream.feed("fine words, " * 6 + "i will hur")
    second = await stream.feed("t you and more")
    rest = await stream.finish()
    assert "hur" not in first.text + second.text + rest.text
    assert stream.blocked
    assert [d.stage for d in stream.decisions] == [Stage.OUTPUT]


async def test_output_stream_with_two_providers_acts_on_the_hits_of_both() -> None:
    flagger = FakeProvider("flagger", [(Category.HARASSMENT, 0.9)])
    mod = Moderator({"rules": RULES, "flagger": flagger}, StreamConfig())
    stream = mod.output_stream(stage("rules", "flagger", pii=Action.REDACT, harassment=Action.FLAG))
    released = await stream.feed("write to a@example.com " + "and more words " * 5)
    rest = await stream.finish()
    assert (released.text + rest.text).startswith("write to [REDACTED:email] and more")
    assert not stream.blocked
    assert stream.num_decisions == len(stream.decisions) == 2
    assert {(d.provider, d.category, d.action) for d in stream.decisions} == {
        ("rules", Category.PII, Action.REDACT),
        ("flagger", Category.HARASSMENT, Action.FLAG),
    }


def test_check_policy_names_the_unknown_provider() -> None:
    mod = Moderator({"rules": RULES}, StreamConfig())
    mod.check_policy(ModerationPolicy(input=stage("rules")))
    with pytest.raises(
        ValueError, match=r"moderation\.output\.providers: unknown provider 'openai'"
    ):
        mod.check_policy(ModerationPolicy(output=stage("openai", hate=Action.BLOCK)))
    assert mod.provider_names == frozenset({"rules"})


def test_window_shorter_than_the_rules_is_refused() -> None:
    long_term = RulesProvider(RuleSet.from_dict({"terms": {"illicit": ["x" * 60]}}))
    with pytest.raises(ValueError, match="raise window_chars to at least 60"):
        Moderator({"rules": long_term}, StreamConfig(window_chars=48))
    Moderator({"rules": long_term}, StreamConfig(window_chars=60))


def test_provider_key_must_match_its_name() -> None:
    with pytest.raises(ValueError, match="named 'rules'"):
        Moderator({"other": RULES}, StreamConfig())


async def test_lifecycle_reaches_managed_providers_only() -> None:
    remote = FakeProvider("remote")
    mod = Moderator({"rules": RULES, "remote": remote}, StreamConfig())
    await mod.start()
    await mod.aclose()
    assert (remote.started, remote.closed) == (1, 1)
