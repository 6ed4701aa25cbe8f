"""Personal-data detectors: a regex finds candidates, a validator (checksum, allocation
rules) keeps the real ones.

The validators are what keeps false positives down: a 16-digit order number is not a card
unless its issuer prefix and Luhn digit agree, a 9-digit group is not an SSN in an area the
SSA never assigns. Phones have no checksum, so they must look like phones: a ``+`` country
code or separated digit groups, 9 to 15 digits, and not a date, an IP address or a
dot-grouped amount. Bare digit runs are never phones (they are usually order or account
numbers).

Detectors run in :data:`PRIORITY` order and a later detector's match that overlaps an
earlier one's is dropped, so a valid card number is reported once as ``payment_card`` and
not again as a ``phone``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True, slots=True)
class PiiMatch:
    """One validated match: which detector, and where."""

    detector: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class PiiDetector:
    """A named candidate regex plus the check a candidate must pass.

    ``validate`` gets the match and returns the span to report (it may trim the match, as
    the IBAN detector does to the country's length), or ``None`` to reject it.
    """

    name: str
    pattern: re.Pattern[str]
    validate: Callable[[re.Match[str]], tuple[int, int] | None]
    max_chars: int | None
    """The longest text a match can span, for the stream window; ``None`` when unbounded."""
    min_digits: int
    """The fewest digits (``\\d``) a validated match holds. ``find_with`` counts a text's
    digits once and skips every detector needing more: most prose has a few digits at most,
    and a streamed answer is checked again at every chunk."""
    gate: str | None = None
    """A character every match contains (an ``@``): one cheap ``in`` skips the detector on
    text without it."""

    def find(self, text: str) -> Iterable[PiiMatch]:
        """Every validated match in ``text``, left to right."""
        if self.gate is not None and self.gate not in text:
            return
        for match in self.pattern.finditer(text):
            span = self.validate(match)
            if span is not None:
                yield PiiMatch(self.name, span[0], span[1])


def _digits(text: str) -> str:
    return "".join(ch for ch in text if ch.isdigit())


def _whole(match: re.Match[str]) -> tuple[int, int]:
    return match.span()


# --- email -------------------------------------------------------------------------------

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_EMAIL = re.compile(
    rf"(?<![\w.%+-])[A-Za-z0-9._%+-]{{1,64}}@{_LABEL}(?:\.{_LABEL})*\.[A-Za-z]{{2,24}}(?![\w-])"
)

# --- phone -------------------------------------------------------------------------------

_PHONE = re.compile(
    r"""
    (?<![\w+])
    (?:
        \+\d{1,3}(?:[ .-]?\(\d{1,4}\))?(?:[ .-]?\d{1,5}){1,6}       # +44 20 7946 0958
      | \(\d{2,5}\)[ .-]?\d{2,5}(?:[ .-]\d{2,5}){1,3}               # (555) 123-4567
      | \d{2,5}[ .-]\d{2,5}(?:[ .-]\d{2,5}){1,3}                    # 020 7946 0958
    )
    (?![\w:])   # a digit group followed by ':' is a clock time, not a phone
    """,
    re.VERBOSE,
)
_DATE_PREFIX = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{2,4}")
_MIN_PHONE_DIGITS = 9
_MAX_PHONE_DIGITS = 15  # E.164


def _phone(match: re.Match[str]) -> tuple[int, int] | None:
    text = match.group()
    if not _MIN_PHONE_DIGITS <= len(_digits(text)) <= _MAX_PHONE_DIGITS:
        return None
    if not text.startswith("+"):
        if _DATE_PREFIX.match(text):
            return None
        groups = re.split(r"[ .()-]+", text.strip("()"))
        if "." in text and all(len(g) <= 3 for g in groups):
            return None  # an IPv4 address or 1.234.567.890
    return match.span()


# --- payment card ------------------------------------------------------------------------

_CARD = re.compile(r"(?<![\w-])\d(?:[ -]?\d){12,18}(?![\w-])")
# Issuer prefixes of the networks people paste (Visa, Mastercard, Amex, Discover, JCB,
# Diners, UnionPay, Maestro): a Luhn-valid number outside them is an account or order id.
_CARD_PREFIX = re.compile(r"4|5[0-8]|2[2-7]|3[04-9]|6(?:011|5|4[4-9]|2)")


def luhn_ok(digits: str) -> bool:
    """The Luhn mod-10 check every payment card number carries in its last digit."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = int(ch)
        if i % 2 == 1:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _card(match: re.Match[str]) -> tuple[int, int] | None:
    text = match.group()
    if "-" in text and " " in text:
        return None  # mixed separators: a list of numbers, not one card
    digits = _digits(text)
    if not 13 <= len(digits) <= 19 or not _CARD_PREFIX.match(digits) or not luhn_ok(digits):
        return None
    return match.span()


# --- IBAN --------------------------------------------------------------------------------

IBAN_LENGTHS: Mapping[str, int] = MappingProxyType(
    {
        "AD": 24, "AE": 23, "AT": 20, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29,
        "CH": 21, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "EE": 20, "ES": 24, "FI": 18,
        "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "HR": 21,
        "HU": 28, "IE": 22, "IL": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20,
        "LB": 28, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22,
        "MK": 19, "MT": 31, "MU": 30, "NL": 18, "NO": 15, "PK": 24, "PL": 28, "PS": 29,
        "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SE": 24, "SI": 19, "SK": 24,
        "SM": 27, "TN": 24, "TR": 26, "UA": 29, "VG": 24,
    }
)  # fmt: skip
"""IBAN length per country (ISO 13616 registry), for the countries whose IBANs we detect."""

_IBAN_MAX = max(IBAN_LENGTHS.values())
_IBAN = re.compile(r"(?<![\w])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{1,4}){3,8}")


def iban_ok(iban: str) -> bool:
    """ISO 7064 mod-97: the check digits make the rearranged number leave remainder 1."""
    rearranged = iban[4:] + iban[:4]
    number = "".join(str(int(ch, 36)) for ch in rearranged)
    return int(number) % 97 == 1


def _iban(match: re.Match[str]) -> tuple[int, int] | None:
    text = match.group()
    length = IBAN_LENGTHS.get(text[:2])
    if length is None:
        return None
    # The regex may run on into a following word; the country fixes where the IBAN ends.
    kept = 0
    end = None
    for i, ch in enumerate(text):
        if ch != " ":
            kept += 1
            if kept == length:
                end = i + 1
                break
    if end is None:
        return None
    after = match.string[match.start() + end : match.start() + end + 1]
    if after.isalnum():
        return None  # longer than the country's IBAN: not one
    if not iban_ok(text[:end].replace(" ", "")):
        return None
    return match.start(), match.start() + end


# --- national ids ------------------------------------------------------------------------

_SSN = re.compile(r"(?<![\w-])(\d{3})([- ])(\d{2})\2(\d{4})(?![\w-])")


def _ssn(match: re.Match[str]) -> tuple[int, int] | None:
    area, group, serial = match.group(1), match.group(3), match.group(4)
    # The SSA never issues area 000, 666 or 900-999, group 00 or serial 0000.
    if area in ("000", "666") or area[0] == "9" or group == "00" or serial == "0000":
        return None
    return match.span()


# First letter never D F I Q U V, second never D F I O Q U V; suffix A-D.
_NINO = re.compile(
    r"(?<!\w)([A-CEGHJ-PR-TW-Z][A-CEGHJ-NPR-TW-Z]) ?(\d{2}) ?(\d{2}) ?(\d{2}) ?([A-D])(?!\w)"
)
_NINO_UNUSED_PREFIXES = frozenset({"BG", "GB", "KN", "NK", "NT", "TN", "ZZ"})


def _nino(match: re.Match[str]) -> tuple[int, int] | None:
    if match.group(1) in _NINO_UNUSED_PREFIXES:
        return None
    return match.span()


_AADHAAR = re.compile(r"(?<![\w-])[2-9]\d{3}([ -]?)\d{4}\1\d{4}(?![\w-])")

_VERHOEFF_D = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
    (1, 2, 3, 4, 0, 6, 7, 8, 9, 5),
    (2, 3, 4, 0, 1, 7, 8, 9, 5, 6),
    (3, 4, 0, 1, 2, 8, 9, 5, 6, 7),
    (4, 0, 1, 2, 3, 9, 5, 6, 7, 8),
    (5, 9, 8, 7, 6, 0, 4, 3, 2, 1),
    (6, 5, 9, 8, 7, 1, 0, 4, 3, 2),
    (7, 6, 5, 9, 8, 2, 1, 0, 4, 3),
    (8, 7, 6, 5, 9, 3, 2, 1, 0, 4),
    (9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
)
_VERHOEFF_P = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9),
    (1, 5, 7, 6, 2, 8, 3, 0, 9, 4),
    (5, 8, 0, 3, 7, 9, 6, 1, 4, 2),
    (8, 9, 1, 6, 0, 4, 3, 5, 2, 7),
    (9, 4, 5, 3, 1, 2, 6, 8, 7, 0),
    (4, 2, 8, 6, 5, 7, 3, 9, 0, 1),
    (2, 7, 9, 3, 8, 0, 6, 4, 1, 5),
    (7, 0, 4, 6, 9, 1, 3, 2, 5, 8),
)


def verhoeff_ok(digits: str) -> bool:
    """The Verhoeff dihedral-group check Aadhaar numbers carry in their last digit."""
    check = 0
    for i, ch in enumerate(reversed(digits)):
        check = _VERHOEFF_D[check][_VERHOEFF_P[i % 8][int(ch)]]
    return check == 0


def _aadhaar(match: re.Match[str]) -> tuple[int, int] | None:
    return match.span() if verhoeff_ok(_digits(match.group())) else None


_DNI = re.compile(r"(?<![\w-])(\d{8})-?([A-Z])(?!\w)")
_DNI_LETTERS = "TRWAGMYFPDXBNJZSQVHLCKE"


def _dni(match: re.Match[str]) -> tuple[int, int] | None:
    number, letter = match.group(1), match.group(2)
    return match.span() if _DNI_LETTERS[int(number) % 23] == letter else None


# --- the table ---------------------------------------------------------------------------

_DIGIT = re.compile(r"\d")
# On ASCII text ``\d`` means 0-9, which re tests by range rather than by Unicode category:
# about twice as fast on prose.
_ASCII_DIGIT = re.compile("[0-9]")

PRIORITY: tuple[PiiDetector, ...] = (
    # Checksummed detectors first: their matches are the most certain. The digit counts are
    # what each pattern (and, for phones, the validator) requires at the least.
    PiiDetector("payment_card", _CARD, _card, 19 + 18, min_digits=13),
    PiiDetector("iban", _IBAN, _iban, _IBAN_MAX + _IBAN_MAX // 4, min_digits=2),
    PiiDetector("in_aadhaar", _AADHAAR, _aadhaar, 14, min_digits=12),
    PiiDetector("es_dni", _DNI, _dni, 10, min_digits=8),
    PiiDetector("us_ssn", _SSN, _ssn, 11, min_digits=9),
    PiiDetector("uk_nino", _NINO, _nino, 13, min_digits=6),
    PiiDetector("email", _EMAIL, _whole, None, min_digits=0, gate="@"),
    PiiDetector("phone", _PHONE, _phone, 32, min_digits=_MIN_PHONE_DIGITS),
)

DETECTORS: Mapping[str, PiiDetector] = MappingProxyType({d.name: d for d in PRIORITY})
"""Every detector by name; rule files switch them on by these names."""


def find_pii(text: str, names: Iterable[str] | None = None) -> list[PiiMatch]:
    """Validated matches of the named detectors (all when ``None``), sorted by start; a
    match overlapping one of a higher-priority detector is dropped."""
    return find_with(text, detectors_named(names))


def detectors_named(names: Iterable[str] | None) -> tuple[PiiDetector, ...]:
    """The named detectors (all when ``None``) in priority order; unknown names raise."""
    if names is None:
        return PRIORITY
    wanted = frozenset(names)
    unknown = wanted - DETECTORS.keys()
    if unknown:
        raise ValueError(f"unknown PII detectors {sorted(unknown)}; use {sorted(DETECTORS)}")
    return tuple(detector for detector in PRIORITY if detector.name in wanted)


def find_with(text: str, detectors: Sequence[PiiDetector]) -> list[PiiMatch]:
    """``find_pii`` over detectors already chosen (``detectors_named``): a stream checks every
    window with the same ones."""
    found: list[PiiMatch] = []
    num_digits = len((_ASCII_DIGIT if text.isascii() else _DIGIT).findall(text))
    for detector in detectors:
        if detector.min_digits > num_digits or (
            detector.gate is not None and detector.gate not in text
        ):
            continue
        for match in detector.find(text):
            if not any(match.start < m.end and m.start < match.end for m in found):
                found.append(match)
    if len(found) > 1:
        found.sort(key=lambda m: m.start)
    return found
