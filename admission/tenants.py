"""Tenants and their API keys.

A key is shown once, when it is issued; only its SHA-256 is stored. Keys are 256 random bits, so
a fast hash is enough (slow KDFs exist to protect low-entropy passwords) and lookups stay cheap
on the request path.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass

from admission.plans import Plan

KEY_PREFIX = "tdm-"
"""Every Tandem API key starts with this, so leaked keys are easy to scan for."""
_DISPLAY_CHARS = 12


@dataclass(frozen=True, slots=True)
class Tenant:
    """A customer of the gateway: the unit of quotas, fairness and billing."""

    tenant_id: str
    name: str
    """Unique, human-chosen (``[a-z0-9][a-z0-9_-]*``); the CLI and admin API accept it too."""
    plan: Plan
    created_at: float
    """Unix seconds."""
    updated_at: float


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A tenant's credential, without its secret."""

    key_id: str
    tenant_id: str
    name: str
    display_prefix: str
    """The key's first characters (``tdm-AbC123xy``), to tell keys apart in listings."""
    key_hash: str
    created_at: float
    revoked_at: float | None = None
    last_used_at: float | None = None

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key as issued: the only time its plaintext exists outside the client."""

    key: ApiKey
    plaintext: str


def new_key_secret() -> str:
    """A fresh API key: the prefix and 256 random bits, URL-safe."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(plaintext: str) -> str:
    """What the registry stores and looks keys up by."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def display_prefix(plaintext: str) -> str:
    return plaintext[:_DISPLAY_CHARS]


def new_id(kind: str) -> str:
    """A random identifier such as ``ten_3f9a...`` or ``key_...``."""
    return f"{kind}_{secrets.token_hex(8)}"
