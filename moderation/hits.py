"""What a provider found in one text: hits with their spans, and per-category scores.

Spans are character offsets into the checked text, so the caller can redact exactly what
matched; remote classifiers give no spans (``start``/``end`` are ``None``: the whole text).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from core.moderation import Category


@dataclass(frozen=True, slots=True)
class Hit:
    """One category found in one text by one provider."""

    category: Category
    provider: str
    """The provider's configured name (recorded on the decision)."""
    start: int | None
    """Offset of the first matched character; ``None`` for a whole-text hit."""
    end: int | None
    """Offset one past the last matched character; ``None`` for a whole-text hit."""
    score: float = 1.0
    """The provider's confidence in [0, 1]; rule matches are certain (1.0)."""
    detector: str | None = None
    """The rule that matched (``email``, ``terms``, a pattern's name), when known."""

    @property
    def whole_text(self) -> bool:
        """True when the provider cannot say where in the text the hit is."""
        return self.start is None or self.end is None


_ALL = frozenset(Category)


@dataclass(frozen=True, slots=True)
class TextResult:
    """Everything the providers found in one text."""

    hits: tuple[Hit, ...]
    scores: Mapping[Category, float]
    """A score for each of the 14 categories; 0.0 where nothing was found."""
    checked: frozenset[Category] = field(default=_ALL)
    """The categories some provider actually looked for. ``/v1/moderations`` reports the
    others with no applied input types rather than claiming a clean check it never made."""

    @property
    def categories(self) -> frozenset[Category]:
        """The categories with at least one hit."""
        return frozenset(hit.category for hit in self.hits)


def scores_of(hits: Iterable[Hit]) -> Mapping[Category, float]:
    """All 14 categories scored: the best hit's score, 0.0 where there is none."""
    scores = dict.fromkeys(Category, 0.0)
    for hit in hits:
        scores[hit.category] = max(scores[hit.category], hit.score)
    return MappingProxyType(scores)


def result_of(hits: Iterable[Hit], checked: frozenset[Category] = _ALL) -> TextResult:
    """A result whose scores follow from its hits (what span-based providers report)."""
    found = tuple(hits)
    return TextResult(found, scores_of(found), checked)


EMPTY_RESULT = TextResult((), scores_of(()), frozenset())
"""What a provider that checked nothing reports (a fail-open remote provider that failed)."""


def merge_results(results: Iterable[TextResult]) -> TextResult:
    """Several providers' results for the same text as one: every hit, the best score per
    category, and every category any of them checked."""
    hits: list[Hit] = []
    scores = dict.fromkeys(Category, 0.0)
    checked: set[Category] = set()
    for result in results:
        hits.extend(result.hits)
        checked |= result.checked
        for category, score in result.scores.items():
            scores[category] = max(scores[category], score)
    return TextResult(tuple(hits), MappingProxyType(scores), frozenset(checked))
