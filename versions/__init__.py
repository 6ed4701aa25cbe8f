"""Model versions: what exactly serves an alias, and who changed what.

A version is immutable and named by a digest of everything that decides its outputs
(``records.VersionManifest``, read off a model folder by ``manifest.manifest_for``). The store
(``store.VersionStore``: a SQLite file, or Redis for replicas) keeps the versions, the traffic
policy of each alias (opaque here: ``traffic`` defines it) with a revision replicas poll, and an
append-only audit log of every change.
"""

from versions.manifest import manifest_for, output_affecting_args
from versions.records import (
    AuditEntry,
    ModelVersion,
    UnknownVersionError,
    VersionConflictError,
    VersionManifest,
    VersionSourceError,
    check_alias,
)
from versions.store import VersionStore

__all__ = [
    "AuditEntry",
    "ModelVersion",
    "UnknownVersionError",
    "VersionConflictError",
    "VersionManifest",
    "VersionSourceError",
    "VersionStore",
    "check_alias",
    "manifest_for",
    "output_affecting_args",
]
