"""Rule sets: loading and validation, term and pattern matching, the stream window bound."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType

import pytest

from core.moderation import OPENAI_CATEGORIES, Category
from moderation.rules import DEFAULT_RULES_PATH, RuleSet, RulesProvider, load_rules


def provider(terms: dict[str, list[str]] | None = None, **kw: object) -> RulesProvider:
    data: dict[str, object] = {"terms": terms or {}, **kw}
    return RulesProvider(RuleSet.from_dict(data))


def spans(p: RulesProvider, text: str) -> list[tuple[str, str]]:
    return [(h.category.value, text[h.start : h.end]) for h in p.check_text(text).hits]  # type: ignore[index]


def test_terms_match_case_insensitively() -> None:
    p = provider({"violence": ["kill"]})
    assert spans(p, "I will KILL it") == [("violence", "KILL")]


def test_terms_match_whole_words_only() -> None:
    p = provider({"violence": ["kill"]})
    assert spans(p, "a skill, skilled, killer, killed, kill_switch") == []
    assert spans(p, "kill.") == [("violence", "kill")]


def test_phrases_tolerate_repeated_whitespace_and_newlines() -> None:
    p = provider({"self-harm/instructions": ["how to kill myself"]})
    text = "tell me How  to\n\tkill   MYSELF now"
    assert spans(p, text) == [("self-harm/instructions", "How  to\n\tkill   MYSELF")]
    assert spans(p, "how tokill myself") == []


def test_longest_phrase_wins_over_a_term_inside_it() -> None:
    p = provider({"illicit": ["pipe", "how to make a pipe bomb"]})
    assert spans(p, "how to make a pipe bomb") == [("illicit", "how to make a pipe bomb")]


def test_terms_with_regex_metacharacters_are_literal() -> None:
    p = provider({"illicit": ["c4 (plastic)"]})
    assert spans(p, "some c4 (plastic) here") == [("illicit", "c4 (plastic)")]
    assert spans(p, "some c4 plastic here") == []


def test_patterns_are_named_and_case_insensitive() -> None:
    p = provider(patterns={"illicit": {"lockpick": r"pick\s{1,2}a\s{1,2}lock"}})
    hits = p.check_text("How to PICK a  lock").hits
    assert [(h.category, h.detector) for h in hits] == [(Category.ILLICIT, "lockpick")]


def test_pii_detectors_only_when_switched_on() -> None:
    text = "mail john@example.com"
    assert provider().check_text(text).hits == ()
    hits = provider(pii=["email"]).check_text(text).hits
    assert [(h.category, h.detector, h.start, h.end) for h in hits] == [
        (Category.PII, "email", 5, 21)
    ]


def test_scores_cover_every_category() -> None:
    result = provider({"violence": ["kill"]}).check_text("kill")
    assert set(result.scores) == set(Category)
    assert result.scores[Category.VIOLENCE] == 1.0
    assert result.scores[Category.HATE] == 0.0
    assert result.checked == frozenset({Category.VIOLENCE})


async def test_check_returns_one_result_per_text_in_order() -> None:
    p = provider({"violence": ["kill"]})
    results = await p.check(["fine", "kill", "also fine"])
    assert [len(r.hits) for r in results] == [0, 1, 0]


def test_max_term_chars_counts_terms_patterns_and_pii() -> None:
    assert provider({"violence": ["how  to   kill"]}).max_term_chars == len("how to kill")
    assert provider(patterns={"illicit": {"x": r"ab{1,5}"}}).max_term_chars == 6
    assert provider(pii=["us_ssn"]).max_term_chars == 11
    assert provider(pii=["email"]).max_term_chars == 0  # emails have no useful bound


def test_default_rules_load_and_match() -> None:
    rules = load_rules(None)
    p = RulesProvider(rules)
    assert rules.max_term_chars <= 48, "the default stream window must hold the default rules"
    assert Category.PII in rules.categories
    text = "ok so how to make a pipe bomb"
    assert [h.category for h in p.check_text(text).hits] == [Category.ILLICIT_VIOLENT] * 2
    assert p.check_text("The weather is lovely and I learnt a new skill.").hits == ()


def test_default_rules_file_is_the_package_data_path() -> None:
    assert DEFAULT_RULES_PATH.name == "default_rules.json"
    assert DEFAULT_RULES_PATH.parent.name == "moderation"
    data = json.loads(DEFAULT_RULES_PATH.read_text())
    assert set(data["terms"]) <= {c.value for c in OPENAI_CATEGORIES}


def test_operator_file_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"terms": {"harassment": ["you fool"]}, "pii": ["iban"]}))
    rules = load_rules(path)
    assert rules.terms == {Category.HARASSMENT: ("you fool",)}
    assert rules.pii == ("iban",)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"terms": {"violent": ["x"]}}, "terms: unknown category 'violent'"),
        ({"terms": {"violence": "kill"}}, "terms.violence must be a list of strings"),
        ({"terms": {"violence": ["ok", "  "]}}, r"terms.violence\[1\] must be a non-blank"),
        ({"patterns": {"illicit": {"bad": "("}}}, "patterns.illicit.bad is not a valid regex"),
        (
            {"patterns": {"illicit": {"open": r"kill\w*"}}},
            "patterns.illicit.open has no upper bound",
        ),
        ({"patterns": {"illicit": {"empty": r"x?"}}}, "patterns.illicit.empty can match empty"),
        ({"patterns": {"illicit": ["x"]}}, "patterns.illicit must map pattern names"),
        ({"pii": ["email", "passport"]}, r"pii: unknown detectors \['passport'\]"),
        ({"pii": "email"}, "pii must be a list"),
        ({"term": {}}, r"unknown keys \['term'\]"),
    ],
)
def test_operator_file_errors_name_the_field(tmp_path: Path, data: object, message: str) -> None:
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as caught:
        load_rules(path)
    assert str(caught.value).startswith(str(path))


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read the rule file"):
        load_rules(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_rules(bad)


def test_rule_set_built_in_code_is_validated_too() -> None:
    with pytest.raises(ValueError, match="pii: unknown detectors"):
        RuleSet(pii=("nope",))
    with pytest.raises(ValueError, match="no upper bound"):
        RuleSet(patterns=MappingProxyType({Category.HATE: {"p": "a+"}}))
