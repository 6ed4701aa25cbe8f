"""Price cards: what a model version costs per 1k input, output and cached tokens.

Cards are append-only. A new card takes effect at its ``effective_from`` (never in the past),
and a record's cost is computed once, when it is written, with the card in effect at the time
the request ended: changing a price never rewrites a past record. Prices are ``Decimal``
currency units per 1k tokens (``0.0000375`` is exact); a request's cost is rounded half-up to
integer micro-units once, over all its tokens.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from billing.records import MICROS_PER_UNIT

_MAX_PRICE = Decimal(1000)  # per 1k tokens: a typo guard (no model costs $1000 per 1k tokens)


class PriceError(ValueError):
    """A price card that cannot be accepted; the message says which field and why."""


@dataclass(frozen=True, slots=True)
class PriceCard:
    """Prices of one model version from ``effective_from_us`` until the next card."""

    model_version: str
    effective_from_us: int
    """Unix microseconds (UTC) from which requests that end are priced by this card."""
    input_per_1k: Decimal
    """Uncached prompt tokens, currency units per 1k."""
    output_per_1k: Decimal
    """Completion tokens, currency units per 1k."""
    cached_input_per_1k: Decimal
    """Prompt tokens served from the prefix cache, currency units per 1k."""
    currency: str = "USD"

    def cost_micros(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> int:
        """What a request with these counts costs, in integer micro-units (half-up)."""
        uncached = prompt_tokens - cached_tokens
        units = (
            uncached * self.input_per_1k
            + cached_tokens * self.cached_input_per_1k
            + completion_tokens * self.output_per_1k
        ) / 1000
        return int((units * MICROS_PER_UNIT).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def parse_price(value: object, field: str) -> Decimal:
    """A price from JSON: a decimal string (preferred, exact) or a number; ``field`` names it
    in the error."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise PriceError(f'{field} must be a decimal string such as "0.00015"')
    try:
        price = Decimal(str(value))
    except InvalidOperation as exc:
        raise PriceError(f'{field} must be a decimal string such as "0.00015"') from exc
    if not price.is_finite() or price < 0 or price > _MAX_PRICE:
        raise PriceError(f"{field} must be between 0 and {_MAX_PRICE} per 1k tokens")
    return price


class PriceBook:
    """Every card, looked up by model version and time (bisect over effective dates)."""

    def __init__(self, cards: Iterable[PriceCard] = ()) -> None:
        self._cards: dict[str, list[PriceCard]] = {}
        for card in cards:
            self._cards.setdefault(card.model_version, []).append(card)
        for history in self._cards.values():
            history.sort(key=lambda card: card.effective_from_us)

    def card_for(self, model_version: str, at_us: int) -> PriceCard | None:
        """The card in effect for ``model_version`` at ``at_us``; None before its first card."""
        history = self._cards.get(model_version)
        if not history:
            return None
        index = bisect.bisect_right([card.effective_from_us for card in history], at_us)
        return history[index - 1] if index else None

    def cards(self) -> list[PriceCard]:
        """All cards, by model version then effective date."""
        return [card for version in sorted(self._cards) for card in self._cards[version]]
