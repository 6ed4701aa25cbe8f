"""What the version registry stores: a version's manifest (its identity), the version, an audit
entry; the alias rule; the registry's errors.

A version's id is a digest of its manifest, so the same weights, tokenizer, template, dtype,
context length, output-affecting engine flags and generation defaults are one version wherever
and whenever they are registered, and any change among them is another version.

Errors (plain exceptions; each message says what to do)::

    UnknownVersionError    no version with that id
    VersionConflictError   that content is already registered under another alias
    VersionSourceError     a model folder or one of its files cannot be read
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from core.models import GenerationDefaults

VERSION_ID_CHARS = 16
"""Hex characters of a version id (64 bits of sha256: no collision among a fleet's versions)."""
NAME_ID_CHARS = 8
"""Hex characters of the id in a version's name ``<alias>@<id8>``."""

_ALIAS = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_VERSION_ID = re.compile(rf"[0-9a-f]{{{VERSION_ID_CHARS}}}")


class UnknownVersionError(Exception):
    """No version with that id: list the registered ones to find the right id."""


class VersionConflictError(Exception):
    """The same content is already registered under another alias: a version belongs to one
    alias, so deploy the existing one or change the content."""


class VersionSourceError(Exception):
    """A model folder or one of its files cannot be read; the message names the file."""


def check_alias(alias: str) -> str:
    """``alias`` if it is a valid model alias, else ``ValueError`` saying the rule."""
    if not _ALIAS.fullmatch(alias):
        raise ValueError(
            f"model alias {alias!r} is invalid: use 1 to 64 of a-z, 0-9, '.', '_', '-', "
            "starting with a letter or digit (no '@': it separates an alias from a version)"
        )
    return alias


@dataclass(frozen=True, slots=True)
class VersionManifest:
    """Everything that decides what a model version outputs; its digest is the version id."""

    weights_sha256: str
    """The weights (and the model's config) as ``versions.manifest`` digests them."""
    tokenizer_sha256: str
    """The tokenizer files, the chat template left out (it has its own digest)."""
    chat_template_sha256: str | None
    """The chat template; None: the model has none (completions only)."""
    dtype: str
    """The dtype vLLM computes in (``--dtype``)."""
    max_model_len: int
    """The context window vLLM serves (``--max-model-len``)."""
    engine_args: tuple[str, ...]
    """The vLLM flags known to change outputs, as ``--flag=value``, sorted."""
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    """What the gateway fills in where a request sets nothing."""

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON-able form (hashed into ``version_id``)."""
        return {
            "weights_sha256": self.weights_sha256,
            "tokenizer_sha256": self.tokenizer_sha256,
            "chat_template_sha256": self.chat_template_sha256,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "engine_args": list(self.engine_args),
            "defaults": self.defaults.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VersionManifest:
        """The inverse of ``to_dict``; ``ValueError`` naming the field for a bad value."""
        template = data.get("chat_template_sha256")
        max_model_len = data.get("max_model_len")
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int):
            raise ValueError("max_model_len: a whole number of tokens")
        engine_args = data.get("engine_args", [])
        if not isinstance(engine_args, list) or not all(isinstance(a, str) for a in engine_args):
            raise ValueError("engine_args: a list of strings")
        defaults = data.get("defaults", {})
        if not isinstance(defaults, dict):
            raise ValueError("defaults: an object")
        if template is not None and not isinstance(template, str):
            raise ValueError("chat_template_sha256: a string or null")
        return cls(
            weights_sha256=_string(data, "weights_sha256"),
            tokenizer_sha256=_string(data, "tokenizer_sha256"),
            chat_template_sha256=template,
            dtype=_string(data, "dtype"),
            max_model_len=max_model_len,
            engine_args=tuple(engine_args),
            defaults=GenerationDefaults.from_dict(defaults),
        )

    @property
    def version_id(self) -> str:
        """The first 16 hex characters of the sha256 of the canonical JSON of ``to_dict``."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:VERSION_ID_CHARS]


@dataclass(frozen=True, slots=True)
class ModelVersion:
    """A registered version of a model alias: immutable once registered."""

    version_id: str
    """``manifest.version_id`` when registered (kept as stored, should the digest evolve)."""
    alias: str
    """The model name clients send; a version belongs to exactly one."""
    manifest: VersionManifest
    source: str
    """What was registered: a folder or GGUF path, as given."""
    model_dir: str
    """The prepared folder vLLM loads."""
    note: str
    """Free text from whoever registered it."""
    created_at: float
    """Unix seconds."""
    created_by: str
    """The admin key id that registered it, or ``"config"`` for one from the gateway's settings."""

    def __post_init__(self) -> None:
        check_alias(self.alias)
        if not _VERSION_ID.fullmatch(self.version_id):
            raise ValueError(f"version id {self.version_id!r}: 16 lowercase hex characters")

    @classmethod
    def new(
        cls,
        alias: str,
        manifest: VersionManifest,
        *,
        source: str,
        model_dir: str,
        created_at: float,
        created_by: str,
        note: str = "",
    ) -> ModelVersion:
        """A version of ``alias`` whose id is its manifest's."""
        return cls(
            manifest.version_id, alias, manifest, source, model_dir, note, created_at, created_by
        )

    @property
    def name(self) -> str:
        """How responses, price cards and the ledger name it: ``<alias>@<8 hex of its id>``."""
        return f"{self.alias}@{self.version_id[:NAME_ID_CHARS]}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form (``name`` included, for readers; ``from_dict`` ignores it)."""
        return {
            "version_id": self.version_id,
            "name": self.name,
            "alias": self.alias,
            "manifest": self.manifest.to_dict(),
            "source": self.source,
            "model_dir": self.model_dir,
            "note": self.note,
            "created_at": self.created_at,
            "created_by": self.created_by,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelVersion:
        """The inverse of ``to_dict``; ``ValueError`` naming the field for a bad value."""
        manifest = data.get("manifest")
        if not isinstance(manifest, dict):
            raise ValueError("manifest: an object")
        return cls(
            version_id=_string(data, "version_id"),
            alias=_string(data, "alias"),
            manifest=VersionManifest.from_dict(manifest),
            source=_string(data, "source"),
            model_dir=_string(data, "model_dir"),
            note=_string(data, "note", ""),
            created_at=_time(data, "created_at"),
            created_by=_string(data, "created_by"),
        )


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One change to versions, deployments or traffic policies, as the audit log keeps it."""

    seq: int
    """Its place in the log, assigned when stored (0 before); increasing."""
    at: float
    """Unix seconds. The log never goes back in time: an entry stamped before the last one
    (two gateways' clocks a little apart) is stored at the last one's time."""
    actor: str
    """Who: an admin key id, or ``"config"``, or a controller's name."""
    action: str
    """What, as ``<object>.<verb>``: ``version.register``, ``deployment.delete``,
    ``policy.set``..."""
    alias: str | None
    """The model alias concerned, if any (the log is filtered by it)."""
    subject: str
    """The version name or alias acted on."""
    before: dict[str, Any] | None
    """The object before the change (None: it did not exist)."""
    after: dict[str, Any] | None
    """The object after the change (None: it no longer exists)."""
    reason: str = ""
    """Why, as the actor said (or a controller's verdict)."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form."""
        return {
            "seq": self.seq,
            "at": self.at,
            "actor": self.actor,
            "action": self.action,
            "alias": self.alias,
            "subject": self.subject,
            "before": self.before,
            "after": self.after,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AuditEntry:
        """The inverse of ``to_dict``; ``ValueError`` naming the field for a bad value."""
        seq = data.get("seq", 0)
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise ValueError("seq: a whole number")
        alias = data.get("alias")
        if alias is not None and not isinstance(alias, str):
            raise ValueError("alias: a string or null")
        return cls(
            seq=seq,
            at=_time(data, "at"),
            actor=_string(data, "actor"),
            action=_string(data, "action"),
            alias=alias,
            subject=_string(data, "subject"),
            before=_object(data, "before"),
            after=_object(data, "after"),
            reason=_string(data, "reason", ""),
        )


def _string(data: dict[str, Any], name: str, default: str | None = None) -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise ValueError(f"{name}: a string")
    return value


def _time(data: dict[str, Any], name: str) -> float:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: Unix seconds")
    return float(value)


def _object(data: dict[str, Any], name: str) -> dict[str, Any] | None:
    value = data.get(name)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{name}: an object or null")
    return value
