"""Where rollout records and their operator commands live: a local SQLite file (one gateway
host) or Redis (replicas). Both implement ``RolloutStore``; what both need to read a record or
check a call is here.

A record is an opaque JSON object owned by the controller; a store reads only its ``id``,
``alias``, ``status`` and ``created_at``, and keeps the whole object as JSON text written by
Python (times round-trip exactly). Invariants every store keeps, each in one atomic step:

- at most one ACTIVE rollout (``running`` or ``paused``) per alias;
- a save carries the fencing token of the lease its gateway holds, and is refused
  (``FencedOutError``) when an older token than the newest one any save has used: a gateway
  that lost the lease can no longer write, even if it does not know yet;
- a rollout's alias never changes, nor its place in the listings (its first ``created_at``);
- commands get seq 1, 2, 3... per rollout, in the order they were pushed.

Errors: ``RolloutConflictError``, ``FencedOutError``, ``UnknownRolloutError`` (a
``LookupError``), ``ValueError`` for a record or argument no store can take, and
``StoreUnavailable`` (``admission.quota``) when the backing store cannot be reached.
"""

from __future__ import annotations

import builtins
import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

ACTIVE_STATUSES = frozenset({"running", "paused"})
"""Statuses of a rollout still under way; the others (succeeded, failed, aborted) are final."""


class RolloutConflictError(Exception):
    """An active rollout already exists for the alias (the message names its id and says to
    abort or finish it first), or a rollout with this id already exists."""


class FencedOutError(Exception):
    """A save with a fencing token older than the newest one seen: another gateway took the
    lease; this one must stop acting."""


class UnknownRolloutError(LookupError):
    """No rollout has this id."""


class RolloutStore(Protocol):
    """Rollout records (opaque JSON objects) and an append-only command log per rollout. Every
    method may raise ``StoreUnavailable`` (``admission.quota``) when the backing store cannot
    be reached."""

    async def start(self) -> None:
        """Reach the store now, so a bad path or URL fails at startup."""
        ...

    async def aclose(self) -> None:
        """Release the file or connections."""
        ...

    async def create(self, record: dict[str, Any]) -> None:
        """Store a new rollout. ``RolloutConflictError`` if an active rollout exists for
        ``record["alias"]``, or one with ``record["id"]`` does; nothing is stored then."""
        ...

    async def get(self, rollout_id: str) -> dict[str, Any] | None:
        """The record of ``rollout_id``, if there is one."""
        ...

    async def list(
        self, *, alias: str | None = None, active: bool | None = None, limit: int = 100
    ) -> builtins.list[dict[str, Any]]:
        """Up to ``limit`` records, newest first by the ``created_at`` they were created with
        (ties: greater id first): of ``alias`` if given; only active ones if ``active`` is
        True, only finished ones if False."""
        ...

    async def save(self, record: dict[str, Any], fence: int) -> None:
        """Replace the stored record of ``record["id"]`` and record ``fence`` as the highest
        fence seen, in one atomic step. ``FencedOutError`` if ``fence`` is below the highest
        fence any save has used (store-wide); ``UnknownRolloutError`` if there is no such
        rollout; ``ValueError`` if the alias differs from the stored one;
        ``RolloutConflictError`` if the record is active and another rollout is active for the
        alias. Nothing changes when it raises."""
        ...

    async def advance_fence(self, fence: int) -> None:
        """Record ``fence`` as the highest fence seen if it is higher. A gateway calls it as
        soon as it acquires the lease, before reading anything: from then on the previous
        holder's saves are refused, even if the new holder has nothing to save yet."""
        ...

    async def push_command(self, rollout_id: str, command: dict[str, Any]) -> int:
        """Append an operator command (``{"action": "pause", "actor": ..., "reason": ...,
        "at": ...}``) to the rollout's log; its seq (1, 2, 3... per rollout).
        ``UnknownRolloutError`` if there is no such rollout."""
        ...

    async def commands(
        self, rollout_id: str, after_seq: int = 0
    ) -> builtins.list[tuple[int, dict[str, Any]]]:
        """The rollout's commands with seq greater than ``after_seq``, oldest first (none for
        an unknown rollout)."""
        ...


@dataclass(frozen=True, slots=True)
class RecordKeys:
    """What a store reads of a record, checked."""

    id: str
    alias: str
    status: str
    created_at: float

    @property
    def active(self) -> bool:
        """Whether the record's status is one of ``ACTIVE_STATUSES``."""
        return self.status in ACTIVE_STATUSES


def record_keys(record: dict[str, Any]) -> RecordKeys:
    """The fields a store reads of ``record``; ``ValueError`` naming the first one missing or
    of the wrong type."""
    for name in ("id", "alias", "status"):
        value = record.get(name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"rollout record {name}: a non-empty string, not {value!r}")
    created_at = record.get("created_at")
    if (
        isinstance(created_at, bool)
        or not isinstance(created_at, int | float)
        or not math.isfinite(created_at)
    ):
        raise ValueError(f"rollout record created_at: Unix seconds, not {created_at!r}")
    return RecordKeys(record["id"], record["alias"], record["status"], float(created_at))


def dump(value: dict[str, Any]) -> str:
    """``value`` as compact JSON text; ``ValueError`` for NaN or infinity, which JSON lacks."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def load(blob: str) -> dict[str, Any]:
    """A stored JSON object back."""
    value = json.loads(blob)
    if not isinstance(value, dict):
        raise ValueError(f"stored JSON is not an object: {blob[:80]!r}")
    return value


def check_fence(fence: int) -> None:
    """``ValueError`` unless ``fence`` is a lease token (a whole number, not negative)."""
    if isinstance(fence, bool) or not isinstance(fence, int) or fence < 0:
        raise ValueError(f"fence: a lease's fencing token (a whole number >= 0), not {fence!r}")


def check_count(name: str, value: int) -> None:
    """``ValueError`` unless ``value`` (a limit, a seq) is a whole number, not negative."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: a whole number >= 0, not {value!r}")


def active_conflict(alias: str, active_id: str) -> RolloutConflictError:
    """The error for a second active rollout of ``alias``."""
    return RolloutConflictError(
        f"rollout {active_id} is already active for alias {alias!r}: abort it or let it "
        "finish first"
    )


def id_taken(rollout_id: str) -> RolloutConflictError:
    """The error for creating a rollout under an id already stored."""
    return RolloutConflictError(f"a rollout with id {rollout_id!r} already exists")


def fenced_out(fence: int, highest: int) -> FencedOutError:
    """The error for a save with a stale fencing token."""
    return FencedOutError(
        f"fencing token {fence} is older than {highest}: another gateway holds the rollout "
        "lease; stop acting on rollouts"
    )


def unknown(rollout_id: str) -> UnknownRolloutError:
    """The error for a rollout id with no record."""
    return UnknownRolloutError(f"no rollout {rollout_id!r}")


def alias_changed(rollout_id: str, stored: str, given: str) -> ValueError:
    """The error for a save that would move a rollout to another alias."""
    return ValueError(
        f"rollout {rollout_id} belongs to alias {stored!r}, not {given!r}: its alias never changes"
    )
