"""Replace matched spans of a text with ``[REDACTED:<label>]``.

Input and output moderation redact the same way, so the client sees one marker format.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from moderation.pii import find_pii


@dataclass(frozen=True, slots=True)
class Redaction:
    """A span to hide and the label that replaces it."""

    start: int
    end: int
    label: str


def marker(label: str) -> str:
    """The text that stands in for a redacted span."""
    return f"[REDACTED:{label}]"


def merge(redactions: Iterable[Redaction]) -> list[Redaction]:
    """Overlapping or touching spans as one (labelled by the span that starts first, the
    longest one on a tie), sorted, so a card number also seen as a phone is hidden once."""
    merged: list[Redaction] = []
    for red in sorted(redactions, key=lambda r: (r.start, -r.end)):
        if merged and red.start <= merged[-1].end:
            last = merged[-1]
            merged[-1] = Redaction(last.start, max(last.end, red.end), last.label)
        else:
            merged.append(red)
    return merged


def apply(text: str, redactions: Iterable[Redaction]) -> str:
    """``text`` with every span replaced by its marker."""
    parts: list[str] = []
    pos = 0
    for red in merge(redactions):
        parts.append(text[pos : red.start])
        parts.append(marker(red.label))
        pos = red.end
    parts.append(text[pos:])
    return "".join(parts)


def scrub_pii(text: str) -> str:
    """``text`` with every PII detector's validated matches replaced by their markers (what a
    kept request log stores)."""
    return apply(text, (Redaction(m.start, m.end, m.detector) for m in find_pii(text)))
