"""The ledger's record and price cards: cost rounding, cached pricing, card lookup by date,
price parsing, time helpers, record validation and serialisation, idempotent record ids."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import orjson
import pytest

from billing.prices import PriceBook, PriceCard, PriceError, parse_price
from billing.records import (
    COLUMNS,
    RequestStatus,
    UsageRecord,
    format_unix_us,
    from_unix_us,
    idempotent_record_id,
    to_unix_us,
)
from tests.billing.records_factory import make_record, make_records


def card(
    input_per_1k: str = "0",
    output_per_1k: str = "0",
    cached_per_1k: str = "0",
    *,
    version: str = "m@1",
    effective_from_us: int = 0,
) -> PriceCard:
    return PriceCard(
        version,
        effective_from_us,
        Decimal(input_per_1k),
        Decimal(output_per_1k),
        Decimal(cached_per_1k),
    )


# --- cost ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "completion", "micros"),
    [
        (1, 0, 1),  # 0.5 micros rounds half-up to 1 (half-even would give 0)
        (2, 0, 1),
        (3, 0, 2),  # 1.5 -> 2
        (5, 0, 3),  # 2.5 -> 3 (half-even would give 2)
        (0, 0, 0),
    ],
)
def test_cost_rounds_half_up(prompt: int, completion: int, micros: int) -> None:
    # 0.0005 per 1k tokens = 0.5 micros per token.
    assert card("0.0005", "0.0005").cost_micros(prompt, completion, 0) == micros


def test_cost_is_rounded_once_over_all_tokens() -> None:
    # 0.5 micros of input + 0.5 micros of output = 1 micro; rounding each would give 2.
    assert card("0.0005", "0.0005").cost_micros(1, 1, 0) == 1
    # 0.4 + 0.4 = 0.8 -> 1; rounding each would give 0.
    assert card("0.0004", "0.0004").cost_micros(1, 1, 0) == 1


def test_cached_tokens_are_priced_at_the_cached_price() -> None:
    priced = card("0.15", "0.60", "0.075")  # per 1k: 150, 600 and 75 micros per token
    # 600 uncached * 150 + 400 cached * 75 + 200 completion * 600
    assert priced.cost_micros(1000, 200, 400) == 600 * 150 + 400 * 75 + 200 * 600
    assert priced.cost_micros(1000, 0, 1000) == 1000 * 75
    assert priced.cost_micros(1000, 0, 0) == 1000 * 150


def test_sub_micro_prices_stay_exact() -> None:
    # 0.0000375 per 1k = 0.0375 micros per token: 40 tokens are exactly 1.5 micros -> 2.
    assert card("0.0000375").cost_micros(40, 0, 0) == 2
    assert card("0.0000375").cost_micros(1_000_000, 0, 0) == 37_500


# --- price book ------------------------------------------------------------------------------


def test_card_for_before_at_and_after_effective_dates() -> None:
    first = card("1", version="m@1", effective_from_us=1_000)
    second = card("2", version="m@1", effective_from_us=5_000)
    other = card("9", version="n@1", effective_from_us=0)
    book = PriceBook([second, other, first])  # any order in
    assert book.card_for("m@1", 999) is None
    assert book.card_for("m@1", 1_000) is first
    assert book.card_for("m@1", 4_999) is first
    assert book.card_for("m@1", 5_000) is second
    assert book.card_for("m@1", 10**18) is second
    assert book.card_for("n@1", 0) is other
    assert book.card_for("unknown@1", 5_000) is None
    assert book.cards() == [first, second, other]
    assert PriceBook().card_for("m@1", 0) is None
    assert PriceBook().cards() == []


# --- parse_price -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0.00015", Decimal("0.00015")),
        ("0.0000375", Decimal("0.0000375")),
        ("0.00015000", Decimal("0.00015")),
        ("0", Decimal(0)),
        ("-0", Decimal(0)),
        ("0.000", Decimal(0)),
        ("1000", Decimal(1000)),
        (2, Decimal(2)),
        (0.5, Decimal("0.5")),
        (0.1, Decimal("0.1")),  # via str(): the shortest repr, not the binary expansion
    ],
)
def test_parse_price_accepts(value: object, expected: Decimal) -> None:
    price = parse_price(value, "input_per_1k")
    assert price == expected
    assert isinstance(price, Decimal)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (True, "decimal string"),
        (None, "decimal string"),
        ([1], "decimal string"),
        ({"v": 1}, "decimal string"),
        ("abc", "decimal string"),
        ("", "decimal string"),
        ("1,5", "decimal string"),
        ("NaN", "between"),
        ("Infinity", "between"),
        (float("inf"), "between"),
        ("-0.1", "between"),
        ("1000.0001", "between"),
        (-1, "between"),
    ],
)
def test_parse_price_errors_name_the_field(value: object, reason: str) -> None:
    with pytest.raises(PriceError, match=f"^output_per_1k must be .*{reason}"):
        parse_price(value, "output_per_1k")


# --- time helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "moment",
    [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(2026, 11, 22, 10, 0, 0, 123, tzinfo=UTC),
        datetime(2026, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(2028, 2, 29, 12, tzinfo=UTC),
    ],
)
def test_unix_us_round_trips(moment: datetime) -> None:
    micros = to_unix_us(moment)
    assert from_unix_us(micros) == moment
    assert from_unix_us(micros).tzinfo is UTC
    assert to_unix_us(from_unix_us(micros)) == micros


def test_to_unix_us_values() -> None:
    assert to_unix_us(datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=UTC)) == 1_000_005
    assert to_unix_us(datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC)) == -1
    # Another offset is the same instant.
    plus_two = timezone(timedelta(hours=2))
    assert to_unix_us(datetime(2026, 11, 1, 2, tzinfo=plus_two)) == to_unix_us(
        datetime(2026, 11, 1, tzinfo=UTC)
    )
    with pytest.raises(ValueError, match="timezone-aware"):
        to_unix_us(datetime(2026, 11, 1))  # naive, on purpose


def test_format_unix_us() -> None:
    assert format_unix_us(0) == "1970-01-01T00:00:00.000000Z"
    assert format_unix_us(1_795_341_600_000_123) == "2026-11-22T10:00:00.000123Z"
    assert format_unix_us(-1) == "1969-12-31T23:59:59.999999Z"


# --- UsageRecord -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"prompt_tokens": -1, "cached_tokens": 0},
        {"completion_tokens": -1},
        {"cached_tokens": -1},
        {"cost_micros": -1},
        {"prompt_tokens": 10, "cached_tokens": 11},
    ],
)
def test_usage_record_rejects_impossible_counts(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"UsageRecord\."):
        make_record(**overrides)


def test_usage_record_is_frozen_and_totals_tokens() -> None:
    record = make_record(prompt_tokens=10, completion_tokens=5, cached_tokens=10)
    assert record.total_tokens == 15
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.cost_micros = 0  # type: ignore[misc]


def test_to_dict_from_dict_round_trip() -> None:
    for record in make_records(60):
        row = record.to_dict()
        assert tuple(row) == COLUMNS
        assert type(row["status"]) is str
        assert UsageRecord.from_dict(row) == record
        # Through JSON bytes too, as the ledger and exports carry it.
        assert UsageRecord.from_dict(orjson.loads(orjson.dumps(row))) == record


def test_from_dict_ignores_unknown_keys_and_checks_the_status() -> None:
    row = make_record().to_dict()
    assert UsageRecord.from_dict({**row, "added_in_a_later_version": 1}) == make_record()
    with pytest.raises(ValueError, match="done"):
        UsageRecord.from_dict({**row, "status": "done"})
    assert RequestStatus("aborted") is RequestStatus.ABORTED


# --- idempotent record ids -------------------------------------------------------------------


def test_idempotent_record_id_is_stable_and_distinct() -> None:
    base = idempotent_record_id("acme", "chat", "key-1")
    assert base == idempotent_record_id("acme", "chat", "key-1")
    assert base.startswith("idem-")
    assert len(base) == len("idem-") + 40
    int(base.removeprefix("idem-"), 16)
    others = {
        idempotent_record_id("globex", "chat", "key-1"),
        idempotent_record_id("acme", "completions", "key-1"),
        idempotent_record_id("acme", "chat", "key-2"),
        # The separator keeps the parts apart: moving text across a boundary changes the id.
        idempotent_record_id("acmec", "hat", "key-1"),
        idempotent_record_id("acme", "chatk", "ey-1"),
    }
    assert base not in others
    assert len(others) == 5
