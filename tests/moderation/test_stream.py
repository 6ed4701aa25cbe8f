"""StreamModerator: a term or PII split across chunks is caught before any of it leaves."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from types import MappingProxyType

import pytest

from core.moderation import Action, Category, ModerationDecision, Stage, StagePolicy
from moderation.hits import Hit
from moderation.rules import RuleSet, RulesProvider
from moderation.stream import CheckFn, Release, StreamConfig, StreamModerator

TERM = "how to kill myself"
RULES = RuleSet.from_dict(
    {"terms": {"self-harm/instructions": [TERM], "violence": ["i will hurt you"]}, "pii": ["email"]}
)
PREAMBLE = "Here is a long and harmless preamble that keeps going for a while. "
TAIL = " and then a long harmless tail that also keeps going for quite a while."


BLOCK_ALL = StagePolicy(("rules",), MappingProxyType({"*": Action.BLOCK}))


def rules_check(rules: RuleSet = RULES, calls: list[str] | None = None) -> CheckFn:
    provider = RulesProvider(rules)

    async def check(text: str) -> list[Hit]:
        if calls is not None:
            calls.append(text)
        return list(provider.check_text(text).hits)

    return check


async def run(
    chunks: Sequence[str],
    pol: StagePolicy = BLOCK_ALL,
    config: StreamConfig | None = None,
    check: CheckFn | None = None,
) -> tuple[str, StreamModerator, list[Release]]:
    mod = StreamModerator(check or rules_check(), pol, config or StreamConfig())
    releases = [await mod.feed(chunk) for chunk in chunks]
    releases.append(await mod.finish())
    return "".join(r.text for r in releases), mod, releases


def split_at(text: str, *cuts: int) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


async def test_term_split_across_two_chunks_is_blocked_before_its_start() -> None:
    text = PREAMBLE + TERM + TAIL
    start = len(PREAMBLE)
    out, mod, releases = await run(split_at(text, start + 8))  # "how to k" | "ill myself..."
    assert out == PREAMBLE
    assert mod.blocked
    assert releases[-1].blocked
    assert mod.decisions == (
        ModerationDecision(
            Stage.OUTPUT, "rules", Category.SELF_HARM_INSTRUCTIONS, Action.BLOCK, "terms"
        ),
    )


async def test_term_split_across_three_chunks_is_blocked_before_its_start() -> None:
    text = PREAMBLE + TERM + TAIL
    start = len(PREAMBLE)
    out, mod, _ = await run(split_at(text, start + 5, start + 11))  # "how t" | "o kill" | " myself"
    assert out == PREAMBLE
    assert mod.blocked


async def test_every_two_way_split_of_the_term_is_caught() -> None:
    text = PREAMBLE + TERM + TAIL
    start = len(PREAMBLE)
    for cut in range(start - 3, start + len(TERM) + 3):
        out, mod, _ = await run(split_at(text, cut))
        assert out == PREAMBLE, cut
        assert mod.blocked, cut


async def test_token_sized_chunks_never_release_the_term() -> None:
    text = PREAMBLE + TERM + TAIL
    chunks = [text[i : i + 3] for i in range(0, len(text), 3)]
    out, mod, releases = await run(chunks)
    assert out == PREAMBLE
    assert mod.blocked
    blocked_at = next(i for i, r in enumerate(releases) if r.blocked)
    assert all(r.text == "" and r.blocked for r in releases[blocked_at + 1 :])


async def test_feeds_after_a_block_release_nothing() -> None:
    mod = StreamModerator(rules_check(), BLOCK_ALL, StreamConfig())
    await mod.feed(PREAMBLE + TERM + TAIL)
    assert mod.blocked
    assert await mod.feed("more innocent text " * 10) == Release("", True)
    assert await mod.finish() == Release("", True)


async def test_email_split_across_chunks_is_redacted() -> None:
    text = "Contact me at john.doe@example.com please, thanks for reading all of this text here."
    pol = StagePolicy(("rules",), MappingProxyType({"pii": Action.REDACT}))
    at = text.index("john")
    out, mod, _ = await run(split_at(text, at + 6, at + 13), pol)
    assert out == text.replace("john.doe@example.com", "[REDACTED:email]")
    assert not mod.blocked
    assert [d.action for d in mod.decisions] == [Action.REDACT]


async def test_email_arriving_token_by_token_is_redacted_whole() -> None:
    email = "someone.with.a.long.name@mail.example.co.uk"
    text = f"{PREAMBLE}reach {email} soon{TAIL}"
    pol = StagePolicy(("rules",), MappingProxyType({"pii": Action.REDACT}))
    out, mod, _ = await run([text[i : i + 2] for i in range(0, len(text), 2)], pol)
    assert out == text.replace(email, "[REDACTED:email]")
    assert len(mod.decisions) == 1


async def test_flag_changes_nothing_and_records_one_decision() -> None:
    text = PREAMBLE + "i will hurt you" + TAIL
    pol = StagePolicy(("rules",), MappingProxyType({"violence": Action.FLAG}))
    out, mod, _ = await run([text[i : i + 4] for i in range(0, len(text), 4)], pol)
    assert out == text
    assert not mod.blocked
    assert mod.decisions == (
        ModerationDecision(Stage.OUTPUT, "rules", Category.VIOLENCE, Action.FLAG, "terms"),
    )


async def test_two_occurrences_are_two_decisions() -> None:
    text = PREAMBLE + "i will hurt you. " + PREAMBLE + "i will hurt you" + TAIL
    pol = StagePolicy(("rules",), MappingProxyType({"violence": Action.FLAG}))
    _, mod, _ = await run([text[i : i + 7] for i in range(0, len(text), 7)], pol)
    assert len(mod.decisions) == 2


async def test_allow_ignores_the_hit() -> None:
    text = PREAMBLE + TERM + TAIL
    pol = StagePolicy(
        ("rules",), MappingProxyType({"self-harm/instructions": Action.ALLOW, "pii": Action.BLOCK})
    )
    out, mod, _ = await run([text], pol)
    assert out == text
    assert mod.decisions == ()


async def test_finish_flushes_what_the_window_held_back() -> None:
    mod = StreamModerator(rules_check(), BLOCK_ALL, StreamConfig())
    assert await mod.feed("short reply") == Release("", False)
    assert await mod.finish() == Release("short reply", False)
    assert await mod.finish() == Release("", False)


async def test_finish_still_checks_the_held_back_tail() -> None:
    out, mod, releases = await run([PREAMBLE, TERM])
    assert [r.blocked for r in releases] == [False, False, True]
    assert releases[-1].text  # the rest of the preamble, held back until now
    assert out == PREAMBLE
    assert mod.blocked


async def test_redaction_then_block_in_one_release() -> None:
    text = "mail a@example.com then " + TERM + TAIL
    pol = StagePolicy(("rules",), MappingProxyType({"pii": Action.REDACT, "*": Action.BLOCK}))
    out, mod, _ = await run([text], pol)
    assert out == "mail [REDACTED:email] then "
    assert [d.action for d in mod.decisions] == [Action.REDACT, Action.BLOCK]


async def test_checked_text_stays_bounded_by_the_window() -> None:
    calls: list[str] = []
    text = "lorem ipsum dolor sit amet " * 200
    config = StreamConfig(window_chars=48, overlap_chars=48)
    out, _, _ = await run(
        [text[i : i + 5] for i in range(0, len(text), 5)],
        config=config,
        check=rules_check(calls=calls),
    )
    assert out == text
    assert max(len(c) for c in calls) <= 48 + 48 + 5


async def test_batch_chars_cuts_the_number_of_checks() -> None:
    text = "lorem ipsum dolor sit amet " * 40  # 1080 chars
    chunks = [text[i : i + 2] for i in range(0, len(text), 2)]
    unbatched: list[str] = []
    batched: list[str] = []
    out1, _, _ = await run(chunks, check=rules_check(calls=unbatched))
    out2, _, releases = await run(
        chunks, config=StreamConfig(batch_chars=200), check=rules_check(calls=batched)
    )
    assert out1 == out2 == text
    assert len(unbatched) > 400
    assert len(batched) <= len(text) // 200 + 1
    assert all(len(r.text) >= 200 for r in releases[:-1] if r.text)


async def test_hit_starting_in_released_overlap_blocks_from_pending_start() -> None:
    # A window shorter than the term (the Moderator refuses this) lets the term's start out;
    # the rest must still be stopped.
    config = StreamConfig(window_chars=5, overlap_chars=48)
    mod = StreamModerator(rules_check(), BLOCK_ALL, config)
    first = await mod.feed("hello how to kill ")
    assert first == Release("hello how to ", False)
    assert await mod.feed("myself now") == Release("", True)
    assert [d.category for d in mod.decisions] == [Category.SELF_HARM_INSTRUCTIONS]


def whole_text_check(category: Category) -> CheckFn:
    async def check(text: str) -> list[Hit]:
        return [Hit(category, "remote", None, None, 0.9)] if "bad" in text else []

    return check


@pytest.mark.parametrize("action", [Action.BLOCK, Action.REDACT])
async def test_whole_text_hit_blocks_the_unreleased_text(action: Action) -> None:
    pol = StagePolicy(("remote",), MappingProxyType({"violence": action}))
    text = PREAMBLE + "bad" + TAIL
    out, mod, _ = await run(
        [PREAMBLE, "bad" + TAIL], pol, check=whole_text_check(Category.VIOLENCE)
    )
    assert mod.blocked
    assert out == text[: len(PREAMBLE) - 48]
    assert [(d.provider, d.action, d.detector) for d in mod.decisions] == [
        ("remote", Action.BLOCK, None)
    ]


async def test_whole_text_flag_is_recorded_once_per_choice() -> None:
    pol = StagePolicy(("remote",), MappingProxyType({"violence": Action.FLAG}))
    text = PREAMBLE + "bad" + TAIL
    out, mod, _ = await run(
        [text[i : i + 3] for i in range(0, len(text), 3)],
        pol,
        check=whole_text_check(Category.VIOLENCE),
    )
    assert out == text
    assert len(mod.decisions) == 1


async def test_disabled_policy_passes_text_through_without_checking() -> None:
    calls: list[str] = []
    mod = StreamModerator(rules_check(calls=calls), StagePolicy(), StreamConfig())
    assert await mod.feed(TERM) == Release(TERM, False)
    assert calls == []


def test_stream_config_validation() -> None:
    with pytest.raises(ValueError, match="window_chars must be a non-negative integer"):
        StreamConfig(window_chars=-1)
    with pytest.raises(ValueError, match="batch_chars"):
        StreamConfig(batch_chars=1.5)  # type: ignore[arg-type]
