"""Changes to versions, deployments and traffic policies, each with its audit entry.

The admin API and ``tandem up``'s declared configuration change them only through these
functions, so nothing changes without the append-only audit log saying who (the admin key's
id, or ``config``), when, what it was before and after, and why.
"""

from __future__ import annotations

import time
from typing import Any

from versions.records import AuditEntry, ModelVersion
from versions.store import VersionStore
from workers.deployments import Deployment

CONFIG_ACTOR = "config"
"""The actor of what ``tandem up``'s configuration declares."""


async def audit(
    store: VersionStore,
    action: str,
    *,
    actor: str,
    alias: str | None,
    subject: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    reason: str,
) -> AuditEntry:
    """Append one entry (``action``: ``version.register``, ``policy.set``, ...)."""
    entry = AuditEntry(0, time.time(), actor, action, alias, subject, before, after, reason)
    return await store.append_audit(entry)


async def register_version(
    store: VersionStore, version: ModelVersion, *, actor: str, reason: str
) -> tuple[ModelVersion, bool]:
    """Record ``version``; the stored one and whether it is new (audited only then)."""
    stored, created = await store.register(version)
    if created:
        await audit(
            store,
            "version.register",
            actor=actor,
            alias=version.alias,
            subject=version.name,
            before=None,
            after=version.to_dict(),
            reason=reason,
        )
    return stored, created


async def delete_version(
    store: VersionStore, version: ModelVersion, *, actor: str, reason: str
) -> None:
    """Remove ``version`` from the registry (the caller checked it is not in use)."""
    await store.delete(version.version_id)
    await audit(
        store,
        "version.delete",
        actor=actor,
        alias=version.alias,
        subject=version.name,
        before=version.to_dict(),
        after=None,
        reason=reason,
    )


async def set_policy(
    store: VersionStore, alias: str, policy: dict[str, Any], *, actor: str, reason: str
) -> bool:
    """Put ``alias``'s policy (already validated); False when it was already in force."""
    before = await store.get_policy(alias)
    if before == policy:
        return False
    await store.put_policy(alias, policy)
    await audit(
        store,
        "policy.set",
        actor=actor,
        alias=alias,
        subject=alias,
        before=before,
        after=policy,
        reason=reason,
    )
    return True


async def delete_policy(store: VersionStore, alias: str, *, actor: str, reason: str) -> bool:
    """Drop ``alias``'s policy (its first deployed version serves it again)."""
    before = await store.get_policy(alias)
    if before is None:
        return False
    await store.delete_policy(alias)
    await audit(
        store,
        "policy.delete",
        actor=actor,
        alias=alias,
        subject=alias,
        before=before,
        after=None,
        reason=reason,
    )
    return True


def deployment_json(deployment: Deployment) -> dict[str, Any]:
    """A deployment as the admin API and the audit log show it."""
    return {
        "version": deployment.version,
        "alias": deployment.model.name,
        "healthy": deployment.healthy,
        "workers": [
            {"name": w.name, "role": str(w.role), "url": w.base_url, "healthy": w.healthy}
            for w in deployment.workers
        ],
    }
