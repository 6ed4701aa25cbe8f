"""PII detectors: real identifiers are found, checksum failures and ordinary numbers are not."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moderation.pii import (
    DETECTORS,
    PRIORITY,
    find_pii,
    find_with,
    iban_ok,
    luhn_ok,
    verhoeff_ok,
)


def found(text: str, detector: str) -> list[str]:
    return [text[m.start : m.end] for m in find_pii(text, [detector])]


@pytest.mark.parametrize(
    "email", ["john.doe@example.com", "a+tag@mail.co.uk", "x_y-z@sub.example-domain.io"]
)
def test_email_is_found_with_its_exact_span(email: str) -> None:
    assert found(f"write to {email}, thanks", "email") == [email]


@pytest.mark.parametrize("text", ["user@localhost", "@example.com", "name@", "a@b.c"])
def test_email_needs_a_domain_with_a_tld(text: str) -> None:
    assert found(text, "email") == []


@pytest.mark.parametrize(
    "phone",
    [
        "+44 20 7946 0958",
        "+1 (415) 555-2671",
        "+14155552671",
        "(415) 555-2671",
        "415-555-2671",
        "415.555.2671",
        "020 7946 0958",
        "+49 30 1234567",
    ],
)
def test_phone_formats(phone: str) -> None:
    assert found(f"call {phone} today", "phone") == [phone]


@pytest.mark.parametrize(
    "text",
    [
        "in 2024",
        "4155552671",  # a bare digit run is an order or account number, not a phone
        "2024-01-15 10:30",
        "15.01.2024",
        "192.168.100.200",
        "1.234.567.890",
        "555-1234",  # 7 digits: too short
        "ext 12-34",
        "+44 20",
    ],
)
def test_phone_false_positives(text: str) -> None:
    assert found(text, "phone") == []


@pytest.mark.parametrize(
    "card", ["4111 1111 1111 1111", "5555-5555-5555-4444", "378282246310005", "4111111111111111"]
)
def test_payment_card_with_valid_luhn(card: str) -> None:
    assert found(f"card: {card}.", "payment_card") == [card]


@pytest.mark.parametrize(
    "text",
    [
        "4111 1111 1111 1112",  # Luhn fails
        "4000123412341235",  # Luhn fails
        "1234567890123456",  # no issuer starts with 1
        "4111 1111-1111 1111",  # mixed separators
        "411111111111",  # 12 digits
    ],
)
def test_payment_card_rejects(text: str) -> None:
    assert found(text, "payment_card") == []


def test_luhn_and_verhoeff_known_vectors() -> None:
    assert luhn_ok("79927398713")
    assert not luhn_ok("79927398710")
    assert verhoeff_ok("2363")  # the textbook example: 236 has check digit 3
    assert not verhoeff_ok("2364")


@pytest.mark.parametrize(
    "iban",
    [
        "DE89 3704 0044 0532 0130 00",
        "GB82 WEST 1234 5698 7654 32",
        "FR14 2004 1010 0505 0001 3M02 606",
        "NL91ABNA0417164300",
    ],
)
def test_iban_with_valid_mod97(iban: str) -> None:
    assert found(f"IBAN {iban} please", "iban") == [iban]


def test_iban_stops_at_the_country_length() -> None:
    assert found("DE89 3704 0044 0532 0130 00 ABCD", "iban") == ["DE89 3704 0044 0532 0130 00"]


@pytest.mark.parametrize(
    "text",
    [
        "DE89 3704 0044 0532 0130 01",  # check digits wrong
        "DE89 3704 0044 0532 0130 0",  # too short for DE
        "DE8937040044053201300012",  # too long for DE
        "XX89 3704 0044 0532 0130 00",  # no such country
    ],
)
def test_iban_rejects(text: str) -> None:
    assert found(text, "iban") == []


def test_iban_mod97() -> None:
    assert iban_ok("GB82WEST12345698765432")
    assert not iban_ok("GB83WEST12345698765432")


def test_us_ssn_valid() -> None:
    assert found("SSN 123-45-6789.", "us_ssn") == ["123-45-6789"]
    assert found("SSN 123 45 6789.", "us_ssn") == ["123 45 6789"]


@pytest.mark.parametrize(
    "text",
    ["000-12-3456", "666-12-3456", "912-12-3456", "123-00-4567", "123-45-0000", "123-45 6789"],
)
def test_us_ssn_never_issued_numbers_are_rejected(text: str) -> None:
    assert found(text, "us_ssn") == []


def test_uk_nino() -> None:
    assert found("NI AB 12 34 56 C ok", "uk_nino") == ["AB 12 34 56 C"]
    assert found("NI AB123456C ok", "uk_nino") == ["AB123456C"]
    for bad in ["BG123456A", "DA123456A", "AO123456A", "AB123456E", "QQ123456C"]:
        assert found(bad, "uk_nino") == [], bad


def test_in_aadhaar_needs_verhoeff() -> None:
    assert found("aadhaar 2341 2341 2346", "in_aadhaar") == ["2341 2341 2346"]
    assert found("aadhaar 234123412346", "in_aadhaar") == ["234123412346"]
    assert found("aadhaar 2341 2341 2347", "in_aadhaar") == []
    assert found("aadhaar 1341 2341 2346", "in_aadhaar") == []  # never starts with 0 or 1


def test_es_dni_letter_check() -> None:
    assert found("DNI 12345678Z", "es_dni") == ["12345678Z"]
    assert found("DNI 12345678-Z", "es_dni") == ["12345678-Z"]
    assert found("DNI 12345678A", "es_dni") == []


def test_ordinary_numbers_are_not_pii() -> None:
    text = (
        "Your order 1234567890123456 shipped on 2024-01-15 at 10:30. Total $1,299.99 "
        "(3 items), ref 4000123412341235. In 1999 and 2024 we sold 12,500,000 units. "
        "Version 3.11.7 runs at 192.168.100.200, invoice 2024-0042, call ext. 1234. "
        "Order #123456789 placed 15.01.2024 10:30:15; 98.6 F; 100,000 USD; ISBN 978-3-16-148410-0."
    )
    assert find_pii(text) == []


def test_a_card_is_reported_once_not_also_as_a_phone() -> None:
    matches = find_pii("card 3782 822463 10005 end")
    assert [m.detector for m in matches] == ["payment_card"]


def test_all_detectors_are_found_in_one_text_in_order() -> None:
    text = "mail a@example.org, card 4111111111111111, ssn 123-45-6789, tel +44 20 7946 0958"
    assert [m.detector for m in find_pii(text)] == ["email", "payment_card", "us_ssn", "phone"]


def test_unknown_detector_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown PII detectors"):
        find_pii("x", ["passport"])
    assert {
        "email",
        "phone",
        "payment_card",
        "iban",
        "us_ssn",
        "uk_nino",
        "in_aadhaar",
        "es_dni",
    } <= set(DETECTORS)


# Texts built from what the detectors match: digit groups (ASCII and other scripts'), letters,
# separators, and the identifiers above, so that matches, near-misses and their mixes occur.
_PIECES = st.sampled_from(
    [
        "4111111111111111", "3782 822463 10005", "123-45-6789", "+44 20 7946 0958",
        "(555) 123-4567", "GB82 WEST 1234 5698 7654 32", "12345678Z", "QQ 12 34 56 C",
        "2345 6789 0124", "a@example.org", "١٢٣٤٥٦٧٨٩", "2024-01-02", "42", " ", "-", ".",
        "(", ")", "+", "x", "AB", "call", "\n",
    ]
)  # fmt: skip


@given(st.lists(st.one_of(_PIECES, st.text("0123456789 -.()+AZaz@", max_size=8)), max_size=12))
def test_skipping_by_digit_count_never_changes_what_is_found(pieces: list[str]) -> None:
    """``min_digits`` is a true lower bound: running every detector whatever the text's digit
    count finds exactly what ``find_pii`` finds."""
    text = "".join(pieces)
    unskipped = [replace(detector, min_digits=0) for detector in PRIORITY]
    assert find_with(text, unskipped) == find_pii(text)
