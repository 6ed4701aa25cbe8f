"""Rule-based moderation: per-category term lists and regexes, plus PII detectors.

A rule file (JSON) has three optional sections::

    {"description": "what this file is for",
     "terms":    {"self-harm/instructions": ["how to kill myself", ...], ...},
     "patterns": {"illicit/violent": {"pipe_bomb_howto": "how\\s{1,3}to\\s{1,3}make ..."}},
     "pii":      ["email", "phone", "payment_card", ...]}

Terms match case-insensitively as whole words or phrases (``kill`` never matches inside
``skill``), with any run of whitespace between a phrase's words. Patterns are regexes,
compiled case-insensitively, named so decisions say which one matched. Every pattern must
have a bounded match length: the output stream holds back a window of text that must be able
to contain a whole match (see :attr:`RuleSet.max_term_chars`).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from core.moderation import Category
from moderation.hits import Hit, TextResult, result_of
from moderation.pii import DETECTORS, detectors_named, find_with
from moderation.prefilter import anchors_regex, fold, pattern_anchor, term_anchor

DEFAULT_RULES_PATH = Path(__file__).with_name("default_rules.json")
"""The rule set shipped with the package (package data)."""

_SECTIONS = frozenset({"description", "terms", "patterns", "pii"})
_CATEGORIES = {c.value: c for c in Category}
TERMS_DETECTOR = "terms"
"""The ``detector`` of a term-list hit (patterns and PII detectors use their own names)."""


def _empty_terms() -> Mapping[Category, tuple[str, ...]]:
    return MappingProxyType({})


def _empty_patterns() -> Mapping[Category, Mapping[str, str]]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class RuleSet:
    """What the rules provider looks for. Built by :func:`load_rules` or directly (tests);
    either way it is validated on construction, with errors naming the field."""

    terms: Mapping[Category, tuple[str, ...]] = field(default_factory=_empty_terms)
    patterns: Mapping[Category, Mapping[str, str]] = field(default_factory=_empty_patterns)
    """Per category, pattern name -> regex."""
    pii: tuple[str, ...] = ()
    """The PII detectors switched on (names from :data:`moderation.pii.DETECTORS`)."""

    def __post_init__(self) -> None:
        for category, terms in self.terms.items():
            for i, term in enumerate(terms):
                if not isinstance(term, str) or not term.split():
                    raise ValueError(f"terms.{category.value}[{i}] must be a non-blank string")
        for category, named in self.patterns.items():
            for name, regex in named.items():
                _pattern_width(regex, f"patterns.{category.value}.{name}")
        unknown = [name for name in self.pii if name not in DETECTORS]
        if unknown:
            raise ValueError(
                f"pii: unknown detectors {unknown}; use any of {', '.join(sorted(DETECTORS))}"
            )

    @property
    def categories(self) -> frozenset[Category]:
        """The categories these rules can find anything in."""
        found = {c for c, terms in self.terms.items() if terms}
        found |= {c for c, named in self.patterns.items() if named}
        if self.pii:
            found.add(Category.PII)
        return frozenset(found)

    @property
    def max_term_chars(self) -> int:
        """The longest text one term, pattern or bounded PII detector can match (a phrase
        counted with single spaces). Emails are left out: they have no useful bound."""
        widths = [len(" ".join(t.split())) for terms in self.terms.values() for t in terms]
        widths += [
            _pattern_width(regex, "")
            for named in self.patterns.values()
            for regex in named.values()
        ]
        widths += [m for name in self.pii if (m := DETECTORS[name].max_chars) is not None]
        return max(widths, default=0)

    @classmethod
    def from_dict(cls, data: Any) -> RuleSet:
        """Parse a rule file's JSON; ``ValueError`` names the bad field."""
        if not isinstance(data, Mapping):
            raise ValueError("a rule file must hold a JSON object")
        unknown = set(data) - _SECTIONS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; use {sorted(_SECTIONS)}")
        if not isinstance(data.get("description", ""), str):
            raise ValueError("description must be a string")
        terms: dict[Category, tuple[str, ...]] = {}
        for key, value in _section(data, "terms").items():
            if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
                raise ValueError(f"terms.{key} must be a list of strings")
            terms[_category(key, "terms")] = tuple(value)
        patterns: dict[Category, Mapping[str, str]] = {}
        for key, value in _section(data, "patterns").items():
            if not isinstance(value, Mapping) or not all(
                isinstance(v, str) for v in value.values()
            ):
                raise ValueError(f"patterns.{key} must map pattern names to regex strings")
            patterns[_category(key, "patterns")] = MappingProxyType(dict(value))
        pii = data.get("pii", [])
        if not isinstance(pii, list) or not all(isinstance(p, str) for p in pii):
            raise ValueError("pii must be a list of detector names")
        return cls(MappingProxyType(terms), MappingProxyType(patterns), tuple(pii))


def _section(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be an object keyed by category")
    return value


def _category(key: str, section: str) -> Category:
    try:
        return _CATEGORIES[key]
    except KeyError:
        raise ValueError(
            f"{section}: unknown category {key!r}; use one of {', '.join(_CATEGORIES)}"
        ) from None


def _pattern_width(regex: str, where: str) -> int:
    """The longest match of ``regex``; ``ValueError`` if it does not compile, can match
    nothing, or has no upper bound. ``re._parser`` (``sre_parse``) is the only place Python
    exposes a regex's width; it is private but stable since 3.11."""
    try:
        compiled = re.compile(regex)
    except re.error as exc:
        raise ValueError(f"{where} is not a valid regex: {exc}") from None
    parser: Any = importlib.import_module("re._parser")
    low, high = parser.parse(compiled.pattern, compiled.flags).getwidth()
    if low == 0:
        raise ValueError(f"{where} can match empty text; make it match at least one character")
    if high >= parser.MAXREPEAT:
        raise ValueError(
            f"{where} has no upper bound on its match length; bound its repeats "
            r"(e.g. \s{1,3} instead of \s+, \w{0,20} instead of \w*) so the output stream's "
            "hold-back window can contain a whole match"
        )
    return int(high)


def load_rules(path: Path | None) -> RuleSet:
    """The rule set in ``path`` (an operator's file), or the shipped default when ``None``.

    Call it at startup: it reads a file. Errors start with the path and name the field.
    """
    source = DEFAULT_RULES_PATH if path is None else path
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the rule file: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{source}: not valid JSON: {exc}") from None
    try:
        return RuleSet.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def _term_regex(terms: Sequence[str]) -> re.Pattern[str]:
    """One alternation for terms: longest first, so a phrase wins over a term it contains;
    ``(?<!\\w)``/``(?!\\w)`` rather than ``\\b`` so terms that start or end with
    punctuation still need a word edge outside them."""
    words = sorted({tuple(t.lower().split()) for t in terms}, key=lambda w: -len(" ".join(w)))
    alternatives = "|".join(r"\s+".join(re.escape(w) for w in phrase) for phrase in words)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)


def _term_gate(terms: Sequence[str]) -> re.Pattern[str] | None:
    """A scan of folded text that finds one word of every term, or ``None`` when some term
    has no ASCII word to look for (then every text gets the full scan)."""
    anchors = [term_anchor(t.lower().split()) for t in terms]
    if not anchors or None in anchors:
        return None
    return anchors_regex(a for a in anchors if a is not None)


class RulesProvider:
    """A :class:`~moderation.provider.ModerationProvider` over a :class:`RuleSet`.

    All regexes are compiled here, once; a check is plain synchronous regex work (well under
    a millisecond for a few thousand characters), so it runs inline on the event loop.
    """

    def __init__(self, rules: RuleSet, name: str = "rules") -> None:
        self.name = name
        self.rules = rules
        self._checked = rules.categories
        self._terms = [
            (category, _term_regex(terms)) for category, terms in rules.terms.items() if terms
        ]
        # Most text matches no term: one scan with every term finds that, and only a text it
        # matches pays for the per-category scans (which keep overlapping hits apart). Before
        # it, a cheaper scan of the folded text for one word of each term (``prefilter``).
        everything = [t for terms in rules.terms.values() for t in terms]
        self._any_term = _term_regex(everything) if everything else None
        self._term_gate = _term_gate(everything)
        self._patterns = [
            (category, name, re.compile(regex, re.IGNORECASE), pattern_anchor(regex))
            for category, named in rules.patterns.items()
            for name, regex in named.items()
        ]
        self._folds = self._term_gate is not None or any(p[3] for p in self._patterns)
        self._pii = detectors_named(rules.pii) if rules.pii else ()
        # Most checks find nothing (a stream is checked at every chunk): one shared, immutable
        # result for them instead of 14 fresh scores each time.
        self._clean = result_of((), self._checked)

    @property
    def max_term_chars(self) -> int:
        """See :attr:`RuleSet.max_term_chars`; the moderator checks the stream window."""
        return self.rules.max_term_chars

    def check_text(self, text: str) -> TextResult:
        """Every hit in one text, with spans."""
        hits: list[Hit] = []
        folded = fold(text) if self._folds else text
        if (
            self._any_term is not None
            and (self._term_gate is None or self._term_gate.search(folded) is not None)
            and self._any_term.search(text) is not None
        ):
            for category, regex in self._terms:
                hits.extend(
                    Hit(category, self.name, m.start(), m.end(), 1.0, TERMS_DETECTOR)
                    for m in regex.finditer(text)
                )
        for category, name, regex, anchor in self._patterns:
            if anchor is not None and anchor not in folded:
                continue
            hits.extend(
                Hit(category, self.name, m.start(), m.end(), 1.0, name)
                for m in regex.finditer(text)
            )
        if self._pii:
            hits.extend(
                Hit(Category.PII, self.name, m.start, m.end, 1.0, m.detector)
                for m in find_with(text, self._pii)
            )
        return result_of(hits, self._checked) if hits else self._clean

    async def check(self, texts: Sequence[str]) -> list[TextResult]:
        """One result per text (see :meth:`check_text`)."""
        return [self.check_text(text) for text in texts]
