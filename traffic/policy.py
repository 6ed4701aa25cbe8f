"""Traffic policies: which versions of an alias serve its requests, and in what shares.

One ``TrafficPolicy`` per alias: a weighted split over versions (sticky per subject or drawn per
request), pins that send a tenant (or one of its keys) to a version, an optional shadow that
receives a copy of a share of the traffic, and whether clients may name a version directly.

Weights and the shadow's share are percents with at most one decimal; they are kept as integer
permille (``Split.permille``) so sums are exact: the split must add up to exactly 1000.

The JSON shape (what the admin API receives and what is stored)::

    {"split": [{"version": "a@1", "weight": 90}, {"version": "a@2", "weight": 10}],
     "sticky": true,
     "pins": [{"tenant": "<tenant id>", "key": "<key id or null>", "version": "a@1"}],
     "shadow": {"version": "a@3", "percent": 5, "max_in_flight": 4},
     "direct_access": true}

``policy_from_dict`` parses it and ``policy_to_dict`` is its exact inverse. Every invalid policy
raises ``PolicyError`` with ``param`` naming the field (``split[1].weight``, ``pins[0].version``),
which the gateway renders as an OpenAI-shaped 400.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

DEFAULT_SHADOW_MAX_IN_FLIGHT = 4
"""Shadow copies of an alias's requests in flight at once on one gateway, unless the policy says."""

_TOP_KEYS = frozenset({"split", "sticky", "pins", "shadow", "direct_access"})
_SPLIT_KEYS = frozenset({"version", "weight"})
_PIN_KEYS = frozenset({"tenant", "key", "version"})
_SHADOW_KEYS = frozenset({"version", "percent", "max_in_flight"})


class PolicyError(ValueError):
    """A traffic policy the gateway refuses; ``param`` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True)
class Split:
    """One version's share of the alias's traffic, in permille (1 = 0.1 %)."""

    version: str
    permille: int


@dataclass(frozen=True, slots=True)
class Pin:
    """Send a tenant's requests to one version. ``key_id`` None: every key of the tenant; a pin
    on a key beats a pin on its tenant."""

    tenant_id: str
    key_id: str | None
    version: str


@dataclass(frozen=True, slots=True)
class Shadow:
    """Copy ``permille`` of the alias's requests to ``version`` (its answers are never returned),
    at most ``max_in_flight`` at once per gateway: past it copies are dropped, not queued."""

    version: str
    permille: int
    max_in_flight: int = DEFAULT_SHADOW_MAX_IN_FLIGHT


@dataclass(frozen=True, slots=True)
class TrafficPolicy:
    """How an alias's requests are spread over its versions. Checked on construction."""

    alias: str
    split: tuple[Split, ...]
    sticky: bool = False
    """Keep each subject (tenant + session or user) on one version while the weights stay."""
    pins: tuple[Pin, ...] = ()
    shadow: Shadow | None = None
    direct_access: bool = True
    """Clients may name a version of this alias (``alias@xxxxxxxx``) in ``model``."""

    def __post_init__(self) -> None:
        _check(self)

    @classmethod
    def single(cls, alias: str, version: str) -> TrafficPolicy:
        """All of the alias's traffic on one version."""
        return cls(alias, (Split(version, 1000),))

    def versions(self) -> frozenset[str]:
        """Every version the policy names: split, pins and shadow."""
        named = {split.version for split in self.split} | {pin.version for pin in self.pins}
        if self.shadow is not None:
            named.add(self.shadow.version)
        return frozenset(named)


def policy_from_dict(alias: str, data: Mapping[str, Any]) -> TrafficPolicy:
    """Parse the JSON shape in the module docstring; ``PolicyError`` names the field at fault."""
    if not isinstance(data, Mapping):
        raise PolicyError("policy", "the traffic policy must be a JSON object")
    _no_unknown_keys(data, _TOP_KEYS, "")
    if "split" not in data:
        raise PolicyError("split", "split is required: a list of {version, weight} summing to 100")
    raw_split = data["split"]
    if not isinstance(raw_split, list):
        raise PolicyError("split", "split must be a list of {version, weight}")
    split = tuple(_split_from_dict(item, f"split[{i}]") for i, item in enumerate(raw_split))
    raw_pins = data.get("pins", [])
    if not isinstance(raw_pins, list):
        raise PolicyError("pins", "pins must be a list of {tenant, key, version}")
    pins = tuple(_pin_from_dict(item, f"pins[{i}]") for i, item in enumerate(raw_pins))
    raw_shadow = data.get("shadow")
    shadow = None if raw_shadow is None else _shadow_from_dict(raw_shadow)
    return TrafficPolicy(
        alias,
        split,
        sticky=_bool(data.get("sticky", False), "sticky"),
        pins=pins,
        shadow=shadow,
        direct_access=_bool(data.get("direct_access", True), "direct_access"),
    )


def policy_to_dict(policy: TrafficPolicy) -> dict[str, Any]:
    """The JSON shape of ``policy``; ``policy_from_dict(policy.alias, it) == policy``."""
    shadow = policy.shadow
    return {
        "split": [{"version": s.version, "weight": _percent(s.permille)} for s in policy.split],
        "sticky": policy.sticky,
        "pins": [
            {"tenant": p.tenant_id, "key": p.key_id, "version": p.version} for p in policy.pins
        ],
        "shadow": None
        if shadow is None
        else {
            "version": shadow.version,
            "percent": _percent(shadow.permille),
            "max_in_flight": shadow.max_in_flight,
        },
        "direct_access": policy.direct_access,
    }


def version_refs(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Every version reference in a policy's JSON, with the field it sits in
    (``split[1].version``, ``pins[0].version``, ``shadow.version``), in that order: what a
    caller resolves (labels, ids) before ``with_versions``. Entries that are not objects are
    skipped: ``policy_from_dict`` refuses them, naming the field."""
    refs: list[tuple[str, Any]] = []
    for key in ("split", "pins"):
        entries = data.get(key)
        if isinstance(entries, list):
            refs += [
                (f"{key}[{i}].version", entry.get("version"))
                for i, entry in enumerate(entries)
                if isinstance(entry, dict)
            ]
    shadow = data.get("shadow")
    if isinstance(shadow, dict):
        refs.append(("shadow.version", shadow.get("version")))
    return refs


def with_versions(data: Mapping[str, Any], versions: Mapping[str, str]) -> dict[str, Any]:
    """A copy of a policy's JSON with the reference in each field of ``versions`` (keyed as
    ``version_refs`` names them) replaced by its value."""
    copied = dict(data)
    for key in ("split", "pins"):
        entries = copied.get(key)
        if isinstance(entries, list):
            copied[key] = [
                {**entry, "version": versions.get(f"{key}[{i}].version", entry.get("version"))}
                if isinstance(entry, dict)
                else entry
                for i, entry in enumerate(entries)
            ]
    shadow = copied.get("shadow")
    if isinstance(shadow, dict):
        copied["shadow"] = {
            **shadow,
            "version": versions.get("shadow.version", shadow.get("version")),
        }
    return copied


def check_versions(
    policy: TrafficPolicy,
    *,
    exists: Callable[[str], bool],
    has_workers: Callable[[str], bool],
) -> None:
    """Refuse a policy that names a version that does not exist (``exists``: the version is one of
    ``policy.alias``'s) or one with no healthy workers: traffic sent there would fail."""
    named = [(f"split[{i}].version", s.version) for i, s in enumerate(policy.split)]
    named += [(f"pins[{i}].version", p.version) for i, p in enumerate(policy.pins)]
    if policy.shadow is not None:
        named.append(("shadow.version", policy.shadow.version))
    for param, version in named:
        if not exists(version):
            raise PolicyError(
                param,
                f"version {version!r} of {policy.alias!r} does not exist; "
                "list the alias's versions and name one of them",
            )
        if not has_workers(version):
            raise PolicyError(
                param,
                f"version {version!r} has no healthy workers; deploy it first "
                "and wait until its workers are healthy",
            )


def _check(policy: TrafficPolicy) -> None:
    """The invariants every policy holds, however it was built."""
    if not policy.alias or "@" in policy.alias:
        raise PolicyError(
            "alias", f"alias must be a non-empty name without '@', got {policy.alias!r}"
        )
    if not policy.split:
        raise PolicyError("split", "split must name at least one version (weights summing to 100)")
    seen: dict[str, int] = {}
    for i, split in enumerate(policy.split):
        _check_version(split.version, f"split[{i}].version")
        if split.version in seen:
            raise PolicyError(
                f"split[{i}].version",
                f"version {split.version!r} is already in split[{seen[split.version]}]; "
                "name each version once",
            )
        seen[split.version] = i
        if split.permille <= 0:
            raise PolicyError(
                f"split[{i}].weight",
                "weight must be more than 0; remove the version from the split instead",
            )
    total = sum(split.permille for split in policy.split)
    if total != 1000:
        raise PolicyError("split", f"weights must sum to exactly 100, got {_percent(total)}")
    pinned: dict[tuple[str, str | None], int] = {}
    for i, pin in enumerate(policy.pins):
        if not pin.tenant_id:
            raise PolicyError(f"pins[{i}].tenant", "tenant must be a tenant id")
        if pin.key_id == "":
            raise PolicyError(f"pins[{i}].key", "key must be a key id, or null for every key")
        _check_version(pin.version, f"pins[{i}].version")
        target = (pin.tenant_id, pin.key_id)
        if target in pinned:
            raise PolicyError(
                f"pins[{i}]",
                f"this tenant and key are already pinned by pins[{pinned[target]}]; keep one pin",
            )
        pinned[target] = i
    shadow = policy.shadow
    if shadow is not None:
        _check_version(shadow.version, "shadow.version")
        if not 0 < shadow.permille <= 1000:
            raise PolicyError("shadow.percent", "percent must be more than 0 and at most 100")
        if shadow.max_in_flight < 1:
            raise PolicyError("shadow.max_in_flight", "max_in_flight must be at least 1")


def _check_version(version: object, param: str) -> None:
    if not isinstance(version, str) or not version:
        raise PolicyError(param, "version must be a version name (alias@xxxxxxxx)")


def _no_unknown_keys(data: Mapping[str, Any], known: frozenset[str], at: str) -> None:
    """Refuse fields the shape does not have (a typo would otherwise be ignored silently)."""
    unknown = sorted(str(key) for key in data if key not in known)
    if unknown:
        raise PolicyError(
            f"{at}.{unknown[0]}" if at else unknown[0],
            f"unknown field(s) {', '.join(unknown)} in {at or 'the policy'}; "
            f"the fields are {', '.join(sorted(known))}",
        )


def _object(data: object, param: str, what: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise PolicyError(param, f"{param} must be an object {what}")
    return data


def _split_from_dict(data: object, at: str) -> Split:
    item = _object(data, at, "{version, weight}")
    _no_unknown_keys(item, _SPLIT_KEYS, at)
    if "weight" not in item:
        raise PolicyError(f"{at}.weight", "weight is required: a percent such as 90 or 0.5")
    return Split(_version(item, at), _permille(item["weight"], f"{at}.weight"))


def _pin_from_dict(data: object, at: str) -> Pin:
    item = _object(data, at, "{tenant, key, version}")
    _no_unknown_keys(item, _PIN_KEYS, at)
    tenant = item.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        raise PolicyError(f"{at}.tenant", "tenant is required: a tenant id")
    key = item.get("key")
    if key is not None and (not isinstance(key, str) or not key):
        raise PolicyError(f"{at}.key", "key must be a key id, or null to pin every key")
    return Pin(tenant, key, _version(item, at))


def _shadow_from_dict(data: object) -> Shadow:
    item = _object(data, "shadow", "{version, percent, max_in_flight}")
    _no_unknown_keys(item, _SHADOW_KEYS, "shadow")
    if "percent" not in item:
        raise PolicyError("shadow.percent", "percent is required: the share of requests copied")
    max_in_flight = item.get("max_in_flight", DEFAULT_SHADOW_MAX_IN_FLIGHT)
    if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int):
        raise PolicyError("shadow.max_in_flight", "max_in_flight must be a whole number >= 1")
    return Shadow(
        _version(item, "shadow"), _permille(item["percent"], "shadow.percent"), max_in_flight
    )


def _version(item: Mapping[str, Any], at: str) -> str:
    version = item.get("version")
    if not isinstance(version, str) or not version:
        raise PolicyError(f"{at}.version", "version is required: a version name (alias@xxxxxxxx)")
    return version


def _bool(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise PolicyError(param, f"{param} must be true or false")
    return value


def _permille(value: object, param: str) -> int:
    """A percent (int, float or decimal string, at most one decimal) as integer permille."""
    # bool is an int: `true` as a weight is a mistake, not 1 %.
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PolicyError(param, f"{param} must be a percent such as 10 or 2.5, got {value!r}")
    try:
        # str() of a float is its shortest round-trip form: 0.1 -> "0.1", not 0.1000000000000000055
        number = Decimal(value) if isinstance(value, int) else Decimal(str(value).strip())
    except InvalidOperation:
        raise PolicyError(
            param, f"{param} must be a percent such as 10 or 2.5, got {value!r}"
        ) from None
    if not number.is_finite() or not 0 <= number <= 100:
        raise PolicyError(param, f"{param} must be a percent from 0 to 100, got {value!r}")
    # Exact on the digits: Decimal arithmetic rounds to 28 digits, so "10.000...01" * 10 could
    # pass for a whole number of permille.
    _, digits, exponent = number.as_tuple()
    if isinstance(exponent, int) and exponent < -1 and any(digits[exponent + 1 :]):
        raise PolicyError(param, f"{param} takes at most one decimal (0.1 % steps), got {value!r}")
    return int(number * 10)


def _percent(permille: int) -> int | float:
    """Permille as the percent the JSON shape shows: 90 for 900, 0.5 for 5."""
    return permille // 10 if permille % 10 == 0 else permille / 10
