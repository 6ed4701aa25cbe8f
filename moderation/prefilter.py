"""Cheap necessary conditions tried before the rules' regexes.

A stream is checked at every chunk and most text matches nothing, so the rules first ask a
question whose "no" is certain: does the text contain a word that every match of a term (or a
literal that every match of a pattern) must contain? Only a "maybe" pays for the exact regex,
which alone decides what is found. A prefilter may say "maybe" wrongly, never "no" wrongly.

The words are looked for in :func:`fold` ed text, with plain (case-sensitive) matching:

- Under ``re.IGNORECASE`` (str patterns) an ASCII text character matches an ASCII pattern
  character exactly when their ASCII lower cases are equal.
- The only non-ASCII characters that match any ASCII character are in :data:`ODD_CASES`
  (``tests/moderation/test_prefilter.py`` checks every code point against ``re``): the dotted
  and dotless i, the long s and the Kelvin sign. ``str.lower`` is not enough for them: it
  keeps the long s and the dotless i, and makes the dotted capital I two characters.

So :func:`fold` replaces those four by their ASCII letter and lower-cases the rest: a stretch of
text that ``re.IGNORECASE`` matches with an ASCII string becomes that string, lower-cased,
character for character. Other characters may change too (and the length with them); they
are in no such stretch, so they can only add a false "maybe". Non-ASCII words and literals
get no prefilter: their rules always run the exact regex.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Sequence
from typing import Any

ODD_CASES: tuple[tuple[str, str], ...] = (
    ("\u0130", "i"),  # LATIN CAPITAL LETTER I WITH DOT ABOVE
    ("\u0131", "i"),  # LATIN SMALL LETTER DOTLESS I
    ("\u017f", "s"),  # LATIN SMALL LETTER LONG S
    ("\u212a", "k"),  # KELVIN SIGN
)
"""Every non-ASCII character that ``re.IGNORECASE`` matches with an ASCII one, and that
ASCII character in lower case."""


def fold(text: str) -> str:
    """``text`` lower-cased, with :data:`ODD_CASES` made ASCII first (see the module doc)."""
    if not text.isascii():  # O(1): CPython knows whether a str is ASCII
        for odd, plain in ODD_CASES:
            if odd in text:
                text = text.replace(odd, plain)
    return text.lower()


# Approximate share (%) of each letter in English text: only which anchor is picked depends
# on it, never what is found. Other characters count as rare as 'v'.
_LETTER_SHARE = dict(
    e=12.7, t=9.1, a=8.2, o=7.5, i=7.0, n=6.7, s=6.3, h=6.1, r=6.0, d=4.3, l=4.0, c=2.8, u=2.8,
    m=2.4, w=2.4, f=2.2, g=2.0, y=2.0, p=1.9, b=1.5, v=1.0, k=0.8, j=0.15, x=0.15, q=0.1,
    z=0.07,
)  # fmt: skip
_OTHER_SHARE = 1.0
# Words too frequent in ordinary answers to make a good anchor when a term has another.
_COMMON = frozenset(
    {
        "a", "about", "am", "an", "and", "are", "as", "at", "back", "be", "been", "better", "but",
        "buy", "by", "can", "could", "did", "do", "does", "end", "for", "from", "get", "go",
        "going", "have", "he", "her", "his", "how", "i", "if", "in", "is", "it", "its", "just",
        "know", "like", "make", "many", "me", "more", "my", "myself", "not", "of", "on", "or",
        "our", "out", "she", "so", "some", "that", "the", "their", "them", "then", "there", "they",
        "this", "to", "up", "want", "was", "way", "we", "were", "what", "when", "where", "which",
        "who", "will", "with", "would", "you", "your", "yourself",
    }
)  # fmt: skip


def _share(ch: str) -> float:
    return _LETTER_SHARE.get(ch, _OTHER_SHARE)


def term_anchor(words: Sequence[str]) -> str | None:
    """The word of a term (its lower-cased words) to look for: an uncommon one with the rarest
    letter, longer on a tie; ``None`` when no word is ASCII."""
    usable = [w for w in words if w.isascii()]
    preferred = [w for w in usable if w not in _COMMON] or usable
    if not preferred:
        return None
    return min(preferred, key=lambda w: (min(map(_share, w)), -len(w)))


def anchors_regex(anchors: Iterable[str]) -> re.Pattern[str]:
    """A plain regex that finds whether folded text contains any of ``anchors``.

    Each anchor is looked for from its rarest character, the characters before it checked by
    a lookbehind, and anchors led by the same character share one alternative: when every
    alternative starts with one literal, ``re`` scans for those characters in C and tries the
    alternatives only where one stands. An anchor that contains another is dropped: the
    shorter one is found wherever the longer one is.
    """
    kept: list[str] = []
    for anchor in sorted(set(anchors), key=len):
        if not any(shorter in anchor for shorter in kept):
            kept.append(anchor)
    led: dict[str, list[str]] = {}
    for anchor in kept:
        i = min(range(len(anchor)), key=lambda k: _share(anchor[k]))
        before = f"(?<={re.escape(anchor[: i + 1])})" if i else ""
        led.setdefault(anchor[i], []).append(before + re.escape(anchor[i + 1 :]))
    return re.compile(
        "|".join(f"{re.escape(lead)}(?:{'|'.join(rests)})" for lead, rests in led.items())
    )


def pattern_anchor(regex: str) -> str | None:
    """The longest run of ASCII literal characters that every match of ``regex`` (compiled
    with ``re.IGNORECASE``) contains, lower-cased: consecutive literals at the top level of
    the pattern, outside any capturing or flagged group, alternation or repeat (``re``'s
    parser opens a bare ``(?:...)``). ``None`` when there is none.

    ``re._parser`` is private but stable since 3.11 (``rules._pattern_width`` reads it too).
    """
    parser: Any = importlib.import_module("re._parser")
    runs = [""]
    for op, av in parser.parse(regex, re.IGNORECASE).data:
        if op is parser.LITERAL and av < 0x80:
            runs[-1] += chr(av)
        elif runs[-1]:
            runs.append("")
    longest = max(runs, key=len).lower()
    return longest or None
