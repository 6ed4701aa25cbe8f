"""Resolving one request to a version: pins, then stickiness or a weighted draw, then a shadow.

Precedence: a pin on the request's key, then a pin on its tenant, then the split (one version:
``only``; sticky: ``sticky``; else a draw per request: ``weighted``). A request that names a
version itself is ``direct`` (``resolve_direct``). The shadow is drawn on its own, on top of any
of these, and skipped when it is the version already serving the request.

Stickiness is weighted rendezvous hashing: every version ``v`` gets a score from a keyed hash of
(alias, version, subject), ``u_v`` uniform in (0, 1), and the subject goes to the version with the
largest ``weight_v / -ln(u_v)`` (equivalently the smallest ``-ln(u_v) / weight_v``: exponential
clocks racing at rates ``weight_v``, so the winner is ``v`` with probability ``weight_v / sum``).
``u_v`` does not depend on the weights, so:

- a subject keeps its version for as long as the weights stay, on every replica (the hash key is
  derived from the alias alone, so replicas agree without sharing state);
- raising one version's weight while lowering the others in proportion only moves subjects *to*
  that version: its clock speeds up and theirs slow down by one factor, so no subject that
  already wins with it loses, and no order among the others changes.

Costs: a weighted or pinned resolution is a few dict lookups and a bisect; a sticky one is one
blake2b per version of the split (a copy of a hasher primed with the key and version).
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
from bisect import bisect_right
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from traffic.policy import TrafficPolicy

_TO_UNIT = 2.0**-52


class Reason(enum.StrEnum):
    """Why a request went to its version (in its log line: ``version=... (reason)``)."""

    PIN = "pin"
    STICKY = "sticky"
    WEIGHTED = "weighted"
    DIRECT = "direct"
    ONLY = "only"


@dataclass(frozen=True, slots=True)
class Subject:
    """Who sends a request. The sticky identity is the tenant plus the session if given, else
    the user, else nothing (the whole tenant is one subject)."""

    tenant_id: str
    key_id: str | None
    user: str | None = None
    session: str | None = None

    def sticky_identity(self) -> bytes:
        """The bytes stickiness hashes; tagged so a session and a user of one name differ."""
        if self.session is not None:
            return f"{self.tenant_id}\x00s\x00{self.session}".encode()
        if self.user is not None:
            return f"{self.tenant_id}\x00u\x00{self.user}".encode()
        return f"{self.tenant_id}\x00t".encode()


@dataclass(frozen=True, slots=True)
class Resolution:
    """The version that serves a request, why, and the version that gets a shadow copy (None:
    no copy)."""

    version: str
    reason: Reason
    shadow: str | None


@dataclass(frozen=True, slots=True)
class CompiledPolicy:
    """A policy with what resolution needs precomputed. Build it with ``compile``."""

    policy: TrafficPolicy
    versions: tuple[str, ...]
    """The split's versions, in its order."""
    thresholds: tuple[float, ...]
    """Cumulative shares of ``versions``; the last is exactly 1.0."""
    only: str | None
    """The version when the split has one, else None."""
    sticky: bool
    key_pins: dict[tuple[str, str], str]
    tenant_pins: dict[str, str]
    hashers: tuple[tuple[str, float, hashlib.blake2b], ...]
    """(version, weight, blake2b primed with the alias's key and the version) per split entry."""
    shadow_version: str | None
    shadow_share: float

    @classmethod
    def compile(cls, policy: TrafficPolicy) -> CompiledPolicy:
        """Precompute thresholds, pin tables and the sticky hashers of ``policy``."""
        cumulative = 0
        thresholds = []
        for split in policy.split:
            cumulative += split.permille
            thresholds.append(
                cumulative / 1000
            )  # 1000 / 1000 is exactly 1.0: bisect stays in range
        # The key is the alias's alone: every replica hashes a subject to the same version.
        key = hashlib.blake2b(
            policy.alias.encode(), digest_size=32, person=b"tandem-sticky"
        ).digest()
        hashers = []
        for split in policy.split:
            hasher = hashlib.blake2b(digest_size=8, key=key)
            hasher.update(split.version.encode() + b"\x00")
            hashers.append((split.version, float(split.permille), hasher))
        shadow = policy.shadow
        return cls(
            policy=policy,
            versions=tuple(split.version for split in policy.split),
            thresholds=tuple(thresholds),
            only=policy.split[0].version if len(policy.split) == 1 else None,
            sticky=policy.sticky,
            key_pins={(p.tenant_id, p.key_id): p.version for p in policy.pins if p.key_id},
            tenant_pins={p.tenant_id: p.version for p in policy.pins if p.key_id is None},
            hashers=tuple(hashers),
            shadow_version=None if shadow is None else shadow.version,
            shadow_share=0.0 if shadow is None else shadow.permille / 1000,
        )


def resolve(
    compiled: CompiledPolicy,
    subject: Subject,
    rand: Callable[[], float] = random.random,
) -> Resolution:
    """The version that serves ``subject``'s request to the alias, by the precedence in the
    module docstring. ``rand`` draws the weighted split (first call) and the shadow (second)."""
    version: str | None = None
    reason = Reason.PIN
    if subject.key_id is not None and compiled.key_pins:
        version = compiled.key_pins.get((subject.tenant_id, subject.key_id))
    if version is None and compiled.tenant_pins:
        version = compiled.tenant_pins.get(subject.tenant_id)
    if version is None:
        if compiled.only is not None:
            version, reason = compiled.only, Reason.ONLY
        elif compiled.sticky:
            version, reason = _rendezvous(compiled, subject.sticky_identity()), Reason.STICKY
        else:
            index = bisect_right(compiled.thresholds, rand())
            version, reason = compiled.versions[index], Reason.WEIGHTED
    shadow = compiled.shadow_version
    # Drawn even when the shadow is the primary, so the draws a seeded test sees do not depend
    # on which version won.
    if shadow is not None and (rand() >= compiled.shadow_share or shadow == version):
        shadow = None
    return Resolution(version, reason, shadow)


def resolve_direct(compiled: CompiledPolicy, version: str, subject: Subject) -> Resolution | None:
    """A request that names ``version`` of the alias itself: served there, never shadowed (it
    is someone trying that version, not the alias's traffic). None when the policy closed
    direct access and ``subject`` is not pinned to ``version`` (by its key or its tenant).
    Whether ``version`` exists is the caller's to check."""
    if compiled.policy.direct_access:
        return Resolution(version, Reason.DIRECT, None)
    key_pin = (
        None
        if subject.key_id is None
        else compiled.key_pins.get((subject.tenant_id, subject.key_id))
    )
    if version not in (key_pin, compiled.tenant_pins.get(subject.tenant_id)):
        return None
    return Resolution(version, Reason.DIRECT, None)


def _rendezvous(compiled: CompiledPolicy, identity: bytes) -> str:
    best_version = ""
    best_clock = math.inf
    for version, weight, primed in compiled.hashers:
        hasher = primed.copy()
        hasher.update(identity)
        # 52 bits + 0.5 over 2**52: exactly representable, so u is in (0, 1) and log(u) < 0.
        unit = ((int.from_bytes(hasher.digest(), "big") >> 12) + 0.5) * _TO_UNIT
        clock = -math.log(unit) / weight
        if clock < best_clock:
            best_version, best_clock = version, clock
    return best_version


class Resolver:
    """Every alias's compiled policy. The table is replaced whole, in one assignment, so a request
    never sees half of a reload (a background task reloads it on every replica)."""

    __slots__ = ("_table",)

    def __init__(self, policies: Mapping[str, TrafficPolicy] | None = None) -> None:
        self._table: dict[str, CompiledPolicy] = {}
        if policies:
            self.replace(policies)

    def replace(self, policies: Mapping[str, TrafficPolicy]) -> None:
        """Swap in ``policies`` (alias -> policy); unchanged policies keep their compiled form."""
        old = self._table
        table: dict[str, CompiledPolicy] = {}
        for alias, policy in policies.items():
            if policy.alias != alias:
                raise ValueError(f"policy for {policy.alias!r} filed under alias {alias!r}")
            current = old.get(alias)
            table[alias] = (
                current
                if current is not None and current.policy == policy
                else CompiledPolicy.compile(policy)
            )
        self._table = table

    def get(self, alias: str) -> CompiledPolicy | None:
        """The alias's compiled policy, None when it has none."""
        return self._table.get(alias)

    def aliases(self) -> list[str]:
        """The aliases that have a policy, sorted."""
        return sorted(self._table)
