"""The rules' prefilters never change what is found: the checks against a plain reference (the
term, pattern and PII scans as they were before any prefilter), on text built from the rules'
own words disguised by case, Unicode look-alikes, punctuation and word edges."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from core.moderation import Category
from moderation.hits import Hit
from moderation.pii import detectors_named
from moderation.prefilter import ODD_CASES, anchors_regex, fold, pattern_anchor, term_anchor
from moderation.rules import TERMS_DETECTOR, RuleSet, RulesProvider, load_rules

DEFAULT = load_rules(None)
DEFAULT_PROVIDER = RulesProvider(DEFAULT)
TERMS = sorted({t for terms in DEFAULT.terms.values() for t in terms})
WORDS = sorted({w for t in TERMS for w in t.split()})
PATTERN_TEXTS = [
    "how to make a pipe bomb",
    "how do i  build an nail bomb",
    "how can i make a pipebomb",
    "how to overdose myself",
    "how do i\thang myself",
]
# PII, some in Arabic-Indic digits (``\d`` in re, counted by the digit skipping too).
PII_TEXTS = [
    "john.doe@example.com", "4111 1111 1111 1111", "+44 20 7946 0958", "123-45-6789",
    "\u0661\u0662\u0663-\u0664\u0665-\u0666\u0667\u0668\u0669", "123-\u0664\u0665-6789",
]  # fmt: skip


# --- the reference: every scan, nothing skipped -------------------------------------------


@functools.cache
def reference_term_regex(terms: tuple[str, ...]) -> re.Pattern[str]:
    """``rules._term_regex`` as it was before the prefilter."""
    words = sorted({tuple(t.lower().split()) for t in terms}, key=lambda w: -len(" ".join(w)))
    alternatives = "|".join(r"\s+".join(re.escape(w) for w in phrase) for phrase in words)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.IGNORECASE)


def reference_hits(rules: RuleSet, text: str, name: str = "rules") -> tuple[Hit, ...]:
    hits: list[Hit] = []
    for category, terms in rules.terms.items():
        if terms:
            regex = reference_term_regex(tuple(terms))
            hits += [Hit(category, name, *m.span(), 1.0, TERMS_DETECTOR) for m in regex.finditer(text)]  # fmt: skip
    for category, named in rules.patterns.items():
        for detector, regex in named.items():
            found = re.finditer(regex, text, re.IGNORECASE)
            hits += [Hit(category, name, *m.span(), 1.0, detector) for m in found]
    pii: list[tuple[int, int, str]] = []
    for pii_detector in detectors_named(rules.pii):
        for match in pii_detector.pattern.finditer(text):
            span = pii_detector.validate(match)
            if span is not None and not any(span[0] < e and s < span[1] for s, e, _ in pii):
                pii.append((*span, pii_detector.name))
    pii.sort(key=lambda m: m[0])
    hits += [Hit(Category.PII, name, s, e, 1.0, detector) for s, e, detector in pii]
    return tuple(hits)


# --- generated text ------------------------------------------------------------------------

# What re.IGNORECASE matches with a letter besides its own cases, and near misses it does not
# match (sharp s is not 'ss' for re; a Cyrillic i is no 'i').
LOOKALIKES: Mapping[str, Sequence[str]] = {
    "s": ("\u017f", "S"),  # long s
    "k": ("\u212a", "K"),  # Kelvin sign
    "i": ("\u0131", "\u0130", "I", "\u0456"),  # dotless i, dotted capital I, Cyrillic i
}


@st.composite
def disguised(draw: st.DrawFn, base: st.SearchStrategy[str]) -> str:
    """``base`` with each character kept, upper-cased or swapped for a look-alike, and now
    and then its 'ss' written 'ß'."""
    text = draw(base)
    if draw(st.booleans()):
        text = text.replace("ss", "\u00df")
    return "".join(draw(st.sampled_from((ch, ch.upper(), *LOOKALIKES.get(ch, ())))) for ch in text)


SEPARATORS = st.sampled_from(
    [" ", "  ", "\n", "\t", "\x1c", "\u00a0", ".", ",", "'", "-", "_", "(", "!", "\u2019",
     "x", "a", "9", "\u00e9", ""]
)  # fmt: skip
PIECES = st.one_of(
    disguised(st.sampled_from(TERMS)),
    disguised(st.sampled_from(WORDS)),
    disguised(st.sampled_from(PATTERN_TEXTS)),
    st.sampled_from(PII_TEXTS),
    SEPARATORS,
    st.text("aiksIKS\u017f\u212a\u0131\u0130\u00df '.-", max_size=6),
)


@settings(max_examples=500)
@given(st.lists(PIECES, max_size=12))
def test_default_rules_find_what_the_plain_scans_find(pieces: list[str]) -> None:
    text = "".join(pieces)
    assert DEFAULT_PROVIDER.check_text(text).hits == reference_hits(DEFAULT, text)


# Rule sets of their own: terms over an alphabet of look-alikes (some with no ASCII word, so
# no prefilter), and patterns whose literal runs sit at the top level or inside groups.
_ALPHABET = "aiksIKS\u017f\u212a\u0131\u0130\u00df'-"
_TERM = st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3).map(" ".join)
_PATTERNS = st.sampled_from(
    [
        r"ki\s{1,2}ss", r"(?x) k i \s? s", r"\bsk(?:i|a)\b", r"(?-i:Ki)s", r"a|kis", r"k{1,2}is",
        "\u212a", "\u017fk", "ki\u00df", r"i(?=k)k", r"(?<!s)kIs", r"[ks]i'k",
    ]
)  # fmt: skip


@settings(max_examples=300)
@given(
    st.lists(_TERM, min_size=1, max_size=4),
    st.lists(_PATTERNS, max_size=3, unique=True),
    st.lists(st.one_of(st.text(_ALPHABET + " .", max_size=8), SEPARATORS), max_size=8),
)
def test_any_rules_find_what_the_plain_scans_find(
    terms: list[str], patterns: list[str], pieces: list[str]
) -> None:
    rules = RuleSet.from_dict(
        {
            "terms": {"violence": terms[:2], "illicit": terms[2:]},
            "patterns": {"hate": {f"p{i}": p for i, p in enumerate(patterns)}},
        }
    )
    text = "".join(pieces)
    assert RulesProvider(rules).check_text(text).hits == reference_hits(rules, text)


# --- the parts -----------------------------------------------------------------------------


def test_odd_cases_are_every_non_ascii_match_of_an_ascii_character() -> None:
    """Checked against ``re`` itself over every code point, so a Python whose Unicode tables
    add a case pair fails here rather than letting the prefilter miss a match."""
    everything = "".join(map(chr, range(0x80, 0x110000)))
    found = {
        (ch, "".join(a for a in map(chr, range(0x80)) if re.fullmatch(re.escape(a), ch, re.I)))
        for ch in re.findall("[\x00-\x7f]", everything, re.IGNORECASE)
    }
    assert found == {(odd, plain.upper() + plain) for odd, plain in ODD_CASES}
    ascii_chars = [chr(c) for c in range(0x80)]
    for ch in ascii_chars:
        same = [a for a in ascii_chars if re.fullmatch(re.escape(a), ch, re.IGNORECASE)]
        assert same == sorted({ch.lower(), ch.upper()})


@given(st.text("abcikst '-.", min_size=1, max_size=5), st.text(max_size=20), st.data())
def test_fold_keeps_every_case_insensitive_ascii_match(
    word: str, around: str, data: st.DataObject
) -> None:
    text = around + data.draw(disguised(st.just(word))) + around
    if re.search(re.escape(word), text, re.IGNORECASE):
        assert word.lower() in fold(text)


@given(
    st.lists(st.text("abkv'-", min_size=1, max_size=5), min_size=1, max_size=6),
    st.text("abkv'- ", max_size=30),
)
def test_anchors_regex_finds_exactly_the_anchors(anchors: list[str], text: str) -> None:
    assert (anchors_regex(anchors).search(text) is not None) == any(a in text for a in anchors)


def test_every_default_term_and_pattern_has_an_anchor() -> None:
    """Else the shipped rules lose their fast path (every window gets the full scans)."""
    assert all(term_anchor(t.lower().split()) is not None for t in TERMS)
    named = {name: regex for named in DEFAULT.patterns.values() for name, regex in named.items()}
    assert {name: pattern_anchor(regex) for name, regex in named.items()} == {
        "bomb_howto": "bomb",
        "suicide_method_howto": "myself",
    }


def test_pattern_anchor_takes_only_top_level_ascii_literals() -> None:
    assert pattern_anchor(r"(?:pipe|nail)\s?Bomb\b") == "bomb"
    assert pattern_anchor(r"ab(cdef)g") == "ab"  # a group's literals are left out
    assert pattern_anchor(r"a(?:bcdef)g") == "abcdefg"  # re's parser opens a bare group
    assert pattern_anchor(r"x|yz") is None  # an alternation: neither side is required
    assert pattern_anchor(r"ab{2}c") == "a"
    assert pattern_anchor("\u212aelvin") == "elvin"  # the Kelvin sign is not ASCII
    assert pattern_anchor("\u212a") is None
