"""Where versions, traffic policies and the audit log live: a local SQLite file (one gateway
host) or Redis (replicas). Both implement ``VersionStore``; what both need to read a version
reference or an audit query is here."""

from __future__ import annotations

import builtins
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from versions.records import (
    NAME_ID_CHARS,
    VERSION_ID_CHARS,
    AuditEntry,
    ModelVersion,
    VersionConflictError,
)

_ID_PREFIX = re.compile(rf"[0-9a-f]{{{NAME_ID_CHARS},{VERSION_ID_CHARS}}}")


class VersionStore(Protocol):
    """Versions (immutable once registered), traffic policies per alias (opaque JSON objects,
    with a revision replicas poll) and an append-only audit log. Every method may raise
    ``StoreUnavailable`` (``admission.quota``) when the backing store cannot be reached."""

    async def start(self) -> None:
        """Reach the store now, so a bad path or URL fails at startup."""
        ...

    async def aclose(self) -> None:
        """Release the file or connections."""
        ...

    async def register(self, version: ModelVersion) -> tuple[ModelVersion, bool]:
        """Store ``version``: ``(version, True)``. Its id already registered under the same
        alias: ``(the stored one, False)`` (registering is idempotent); under another alias:
        ``VersionConflictError``."""
        ...

    async def get(self, ref: str) -> ModelVersion | None:
        """The version ``ref`` names: its full id, its name ``<alias>@<id8>``, or a prefix of
        its id of at least 8 hex characters. None when none matches, or several do."""
        ...

    async def list(self, alias: str | None = None) -> builtins.list[ModelVersion]:
        """Every version (of ``alias``, if given), oldest first."""
        ...

    async def delete(self, version_id: str) -> ModelVersion:
        """Remove a version, returning it; ``UnknownVersionError`` if there is none. The caller
        checks first that no deployment uses it."""
        ...

    async def get_policy(self, alias: str) -> dict[str, Any] | None:
        """The traffic policy of ``alias``, if one is set."""
        ...

    async def list_policies(self) -> dict[str, dict[str, Any]]:
        """Every traffic policy, by alias."""
        ...

    async def put_policy(self, alias: str, policy: dict[str, Any]) -> int:
        """Set the traffic policy of ``alias``; the new policy revision."""
        ...

    async def delete_policy(self, alias: str) -> bool:
        """Remove the traffic policy of ``alias``; False if it had none (the revision is then
        unchanged)."""
        ...

    async def policy_revision(self) -> int:
        """A counter bumped in the same atomic step as every policy change (0: never changed).
        One cheap round trip: replicas poll it and reload the policies when it moved."""
        ...

    async def append_audit(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry`` (its ``seq`` is ignored); the stored entry, with its ``seq`` (greater
        than every earlier one) and its ``at`` (never before the previous entry's)."""
        ...

    async def audit(
        self,
        *,
        alias: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEntry]:
        """Up to ``limit`` entries, oldest first: about ``alias`` if given, stamped at or after
        ``since`` and before ``until`` where given."""
        ...


@dataclass(frozen=True, slots=True)
class VersionRef:
    """A parsed version reference: an id prefix (the full id is a prefix too), and the alias a
    name carries."""

    id_prefix: str
    alias: str | None = None

    @property
    def is_full_id(self) -> bool:
        """Whether the prefix is a whole version id."""
        return len(self.id_prefix) == VERSION_ID_CHARS


def parse_ref(ref: str) -> VersionRef | None:
    """``ref`` as an id prefix (and alias), or None when it cannot name a version."""
    alias, at, id_part = ref.rpartition("@")
    if at and not alias:
        return None
    if not _ID_PREFIX.fullmatch(id_part):
        return None
    return VersionRef(id_part, alias or None)


def pick(ref: VersionRef, candidates: builtins.list[ModelVersion]) -> ModelVersion | None:
    """The one version among those whose id starts with ``ref``'s prefix that ``ref`` names:
    None when there are none, or several (an ambiguous prefix), or its alias is another."""
    if len(candidates) != 1:
        return None
    (version,) = candidates
    if ref.alias is not None and version.alias != ref.alias:
        return None
    return version


def already_registered(existing: ModelVersion, new: ModelVersion) -> tuple[ModelVersion, bool]:
    """What ``register`` answers when ``new``'s id is already stored, as ``existing``."""
    if existing.alias != new.alias:
        raise VersionConflictError(
            f"this content is already registered as {existing.name}: deploy that version, "
            f"or change the model or its settings to register a new one under {new.alias!r}"
        )
    return existing, False


def check_audit_query(since: float | None, until: float | None, limit: int) -> None:
    """``ValueError`` for an audit query no store can answer."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError("limit: a whole number of entries, at least 0")
    for name, value in (("since", since), ("until", until)):
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name}: Unix seconds")


def check_audit_time(entry: AuditEntry) -> None:
    """``ValueError`` unless ``entry.at`` is a time the log can file (finite, not negative)."""
    if not math.isfinite(entry.at) or entry.at < 0:
        raise ValueError(f"audit entry time {entry.at!r}: Unix seconds, not negative")
