"""Plans, tenants and keys as JSON-safe dicts: the one format both registries store and the admin
API speaks.

Decoding is lenient where schemas evolve (unknown keys are ignored, a missing plan field takes
the ``Plan`` default, so a record written by a newer or older gateway still loads) and strict
where a wrong value would silently change a limit (a string ``tpm``, an unknown band).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from admission.plans import Plan, PriorityBand
from admission.tenants import ApiKey, Tenant
from core.moderation import ModerationPolicy

_PLAN_FIELDS = tuple(field.name for field in dataclasses.fields(Plan))  # declaration order
_INT_LIMITS = ("tpm", "rpm", "max_concurrent", "max_prompt_tokens", "max_output_tokens")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """Every field of the plan; the band as its string value."""
    data = {name: getattr(plan, name) for name in _PLAN_FIELDS}
    data["band"] = plan.band.value
    data["moderation"] = None if plan.moderation is None else plan.moderation.to_dict()
    return data


def plan_from_dict(data: Mapping[str, Any]) -> Plan:
    """The inverse of ``plan_to_dict``; ``ValueError`` names the first bad field."""
    kwargs = {name: value for name, value in data.items() if name in _PLAN_FIELDS}
    for name in _INT_LIMITS:
        value = kwargs.get(name)
        # bool is an int subclass, and ``true`` as a limit is surely a mistake.
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"plan field {name!r} must be an integer or null, got {value!r}")
    if "weight" in kwargs:
        weight = kwargs["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise ValueError(f"plan field 'weight' must be a number, got {weight!r}")
        kwargs["weight"] = float(weight)
    if "band" in kwargs:
        try:
            kwargs["band"] = PriorityBand(kwargs["band"])
        except ValueError:
            choices = ", ".join(band.value for band in PriorityBand)
            raise ValueError(
                f"plan field 'band' must be one of {choices}, got {kwargs['band']!r}"
            ) from None
    moderation = kwargs.get("moderation")
    if moderation is not None:
        if not isinstance(moderation, Mapping):
            raise ValueError("plan field 'moderation' must be an object or null")
        kwargs["moderation"] = ModerationPolicy.from_dict(moderation)
    return Plan(**kwargs)


def tenant_to_dict(tenant: Tenant) -> dict[str, Any]:
    """A tenant with its plan nested as ``plan_to_dict`` writes it."""
    return {
        "tenant_id": tenant.tenant_id,
        "name": tenant.name,
        "plan": plan_to_dict(tenant.plan),
        "created_at": tenant.created_at,
        "updated_at": tenant.updated_at,
    }


def tenant_from_dict(data: Mapping[str, Any]) -> Tenant:
    """The inverse of ``tenant_to_dict``; ``KeyError`` when a required field is missing."""
    return Tenant(
        tenant_id=str(data["tenant_id"]),
        name=str(data["name"]),
        plan=plan_from_dict(data.get("plan") or {}),
        created_at=float(data["created_at"]),
        updated_at=float(data["updated_at"]),
    )


def key_to_dict(key: ApiKey) -> dict[str, Any]:
    """Every field of the key (which holds its hash, never its plaintext)."""
    return {
        "key_id": key.key_id,
        "tenant_id": key.tenant_id,
        "name": key.name,
        "display_prefix": key.display_prefix,
        "key_hash": key.key_hash,
        "created_at": key.created_at,
        "revoked_at": key.revoked_at,
        "last_used_at": key.last_used_at,
    }


def key_from_dict(data: Mapping[str, Any]) -> ApiKey:
    """The inverse of ``key_to_dict``; ``KeyError`` when a required field is missing."""
    return ApiKey(
        key_id=str(data["key_id"]),
        tenant_id=str(data["tenant_id"]),
        name=str(data["name"]),
        display_prefix=str(data["display_prefix"]),
        key_hash=str(data["key_hash"]),
        created_at=float(data["created_at"]),
        revoked_at=_optional_float(data.get("revoked_at")),
        last_used_at=_optional_float(data.get("last_used_at")),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
