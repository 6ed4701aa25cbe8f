"""``VersionStore`` in Redis, shared by every gateway replica pointed at the same server.

Keys (``<p>`` is ``key_prefix``):

- ``<p>version:<id>``           string: the version as ``ModelVersion.to_dict`` JSON
- ``<p>versions``               sorted set: version ids by ``created_at`` (listing, oldest first)
- ``<p>version_ids``            sorted set: version ids, all scored 0 (id prefixes by
  ``ZRANGEBYLEX``)
- ``<p>alias:<alias>``          sorted set: the alias's version ids by ``created_at``
- ``<p>policies``               hash: alias -> traffic policy JSON
- ``<p>policy_revision``        string: the policy revision (``INCR``, absent: 0)
- ``<p>audit``                  stream: the audit log; fields ``seq``, ``at`` (``repr`` of the
  float), ``data`` (the entry's other fields as JSON)
- ``<p>audit:alias:<alias>``    stream: the entries of one alias again, under the same ids
- ``<p>audit:seq``              string: the last ``seq`` handed out (``INCR``)

An audit entry's stream id is ``<its at in whole milliseconds>-<n>``, made by the appending
script rather than the server's clock, so ``since``/``until`` are ``XRANGE`` bounds and ``at``
never decreases along the log: an entry stamped before the last one (two gateways' clocks a
little apart) takes the last one's ``at``. Times travel as Python's ``repr`` and JSON is written
by Python only: Lua's cjson keeps 14 significant digits, which would round them.

Every change spanning several keys is one Lua script (or one script's ``INCR`` with the
policy change), hence atomic. The delete script reaches the alias's set by a key it computes from
the prefix, so on Redis Cluster the prefix must carry a hash tag (``{tandem}:``).
"""

from __future__ import annotations

import builtins
import json
import math
from collections.abc import Awaitable
from typing import Any, TypeVar, cast

from admission.redis_conn import bounded, connect
from versions.records import AuditEntry, ModelVersion, UnknownVersionError
from versions.store import (
    already_registered,
    check_audit_query,
    check_audit_time,
    parse_ref,
    pick,
)

_T = TypeVar("_T")
_StreamPage = list[tuple[str, dict[str, str]]]

# KEYS: version, versions, version_ids, alias set. ARGV: id, version JSON, created_at.
# Reply: nil (stored), or the JSON already stored under that id.
_REGISTER = """
local existing = redis.call('GET', KEYS[1])
if existing then return existing end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[3], 0, ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
return false
"""

# KEYS: version, versions, version_ids. ARGV: id, prefix. Reply: the deleted JSON, or nil.
_DELETE = """
local blob = redis.call('GET', KEYS[1])
if not blob then return false end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', ARGV[2] .. 'alias:' .. cjson.decode(blob)['alias'], ARGV[1])
return blob
"""

# KEYS: policies, revision. ARGV: alias, policy JSON. Reply: the new revision.
_PUT_POLICY = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return redis.call('INCR', KEYS[2])
"""

# KEYS: policies, revision. ARGV: alias. Reply: the new revision, or 0 (no such policy).
_DELETE_POLICY = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
return redis.call('INCR', KEYS[2])
"""

# KEYS: log, seq counter, the alias's log (absent for an entry without alias).
# ARGV: at (repr), at in whole milliseconds, data JSON. Reply: {seq, at as stored}.
# Ids are compared as strings of digits without leading zeros; times as doubles (tonumber
# reads Python's repr back exactly).
_APPEND_AUDIT = """
local at, ms, n = ARGV[1], ARGV[2], 0
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if last then
  local dash = string.find(last[1], '-', 1, true)
  local last_ms = string.sub(last[1], 1, dash - 1)
  local fields = last[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'at' and tonumber(fields[i + 1]) > tonumber(at) then
      at, ms = fields[i + 1], last_ms
    end
  end
  if ms == last_ms then n = tonumber(string.sub(last[1], dash + 1)) + 1 end
end
if ms == '0' and n == 0 then n = 1 end
local seq = redis.call('INCR', KEYS[2])
local id = redis.call('XADD', KEYS[1], ms .. '-' .. n, 'seq', seq, 'at', at, 'data', ARGV[3])
if KEYS[3] then redis.call('XADD', KEYS[3], id, 'seq', seq, 'at', at, 'data', ARGV[3]) end
return {seq, at}
"""


class RedisVersionStore:
    """Versions, policies and the audit log in Redis; see the module docstring for the keys.
    Construction does no I/O; connections open on first use (or ``start()``)."""

    def __init__(
        self, url: str, *, timeout_s: float = 2.0, key_prefix: str = "tandem:versions:"
    ) -> None:
        self._redis = connect(url, timeout_s)  # see admission/redis_conn.py
        self._p = key_prefix
        # Bounds one round trip (connect, EVALSHA, the script-cache fallback after a restart),
        # where the socket timeouts bound each operation alone.
        self._deadline_s = 2 * timeout_s
        self._register = self._redis.register_script(_REGISTER)
        self._delete = self._redis.register_script(_DELETE)
        self._put_policy = self._redis.register_script(_PUT_POLICY)
        self._delete_policy = self._redis.register_script(_DELETE_POLICY)
        self._append_audit = self._redis.register_script(_APPEND_AUDIT)

    async def start(self) -> None:
        """Reach the server now (one ``PING``); ``StoreUnavailable`` if it does not answer."""
        await self._run(self._redis.ping())

    async def aclose(self) -> None:
        """Release the connections."""
        await self._redis.aclose()

    async def register(self, version: ModelVersion) -> tuple[ModelVersion, bool]:
        """Store ``version``; idempotent under its alias, ``VersionConflictError`` under
        another (see ``VersionStore.register``). One round trip."""
        version_id = version.version_id
        keys = [
            self._version_key(version_id),
            self._versions_key(),
            self._ids_key(),
            self._alias_key(version.alias),
        ]
        args = [version_id, json.dumps(version.to_dict()), repr(version.created_at)]
        existing = await self._run(self._register(keys, args))
        if existing is None:
            return version, True
        return already_registered(ModelVersion.from_dict(json.loads(existing)), version)

    async def get(self, ref: str) -> ModelVersion | None:
        """The version ``ref`` names (full id, ``<alias>@<id8>``, unique id prefix)."""
        parsed = parse_ref(ref)
        if parsed is None:
            return None
        if parsed.is_full_id:
            ids = [parsed.id_prefix]
        else:
            # Ids are hex, every character below 'g': they all sort under prefix + 'g'. Two
            # are enough to tell an ambiguous prefix.
            lower, upper = f"[{parsed.id_prefix}", f"({parsed.id_prefix}g"
            ids = _strs(
                await self._run(self._redis.zrangebylex(self._ids_key(), lower, upper, 0, 2))
            )
        if len(ids) != 1:
            return None
        return pick(parsed, await self._versions(ids))

    async def list(self, alias: str | None = None) -> builtins.list[ModelVersion]:
        """Every version (of ``alias``, if given), oldest first (ties by id)."""
        key = self._versions_key() if alias is None else self._alias_key(alias)
        return await self._versions(_strs(await self._run(self._redis.zrange(key, 0, -1))))

    async def delete(self, version_id: str) -> ModelVersion:
        """Remove a version, returning it; ``UnknownVersionError`` if there is none."""
        keys = [self._version_key(version_id), self._versions_key(), self._ids_key()]
        blob = await self._run(self._delete(keys, [version_id, self._p]))
        if blob is None:
            raise UnknownVersionError(f"no model version {version_id!r}")
        return ModelVersion.from_dict(json.loads(blob))

    async def get_policy(self, alias: str) -> dict[str, Any] | None:
        """The traffic policy of ``alias``, if one is set."""
        blob = await self._run(self._redis.hget(self._policies_key(), alias))
        return None if blob is None else _object(str(blob))

    async def list_policies(self) -> dict[str, dict[str, Any]]:
        """Every traffic policy, by alias."""
        blobs = await self._run(self._redis.hgetall(self._policies_key()))
        return {str(alias): _object(str(blob)) for alias, blob in sorted(blobs.items())}

    async def put_policy(self, alias: str, policy: dict[str, Any]) -> int:
        """Set the traffic policy of ``alias``; the new policy revision. One round trip."""
        keys = [self._policies_key(), self._revision_key()]
        blob = json.dumps(policy, separators=(",", ":"))
        return int(await self._run(self._put_policy(keys, [alias, blob])))

    async def delete_policy(self, alias: str) -> bool:
        """Remove the traffic policy of ``alias``; False if it had none. One round trip."""
        keys = [self._policies_key(), self._revision_key()]
        return int(await self._run(self._delete_policy(keys, [alias]))) != 0

    async def policy_revision(self) -> int:
        """The policy revision (0: policies never changed). One ``GET``."""
        revision = await self._run(self._redis.get(self._revision_key()))
        return 0 if revision is None else int(revision)

    async def append_audit(self, entry: AuditEntry) -> AuditEntry:
        """Append ``entry``; the stored entry with its ``seq`` and ``at`` (never before the
        previous entry's). One round trip."""
        check_audit_time(entry)
        keys = [self._audit_key(), self._audit_seq_key()]
        if entry.alias is not None:
            keys.append(self._audit_alias_key(entry.alias))
        data = {k: v for k, v in entry.to_dict().items() if k not in ("seq", "at")}
        args = [repr(entry.at), str(_ms(entry.at)), json.dumps(data)]
        seq, at = await self._run(self._append_audit(keys, args))
        return AuditEntry.from_dict({**data, "seq": int(seq), "at": float(at)})

    async def audit(
        self,
        *,
        alias: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEntry]:
        """Up to ``limit`` entries, oldest first, filtered by alias and ``[since, until)``."""
        check_audit_query(since, until, limit)
        key = self._audit_key() if alias is None else self._audit_alias_key(alias)
        # Whole milliseconds bound the range; the entries of the first and last millisecond
        # are then checked against the exact times, so a page may keep fewer than it read.
        start = "-" if since is None else str(_ms(since))
        end = "+" if until is None else str(_ms(until))
        entries: list[AuditEntry] = []
        while len(entries) < limit:
            # decode_responses: ids and fields are str (redis-py's types allow bytes too).
            page = cast(_StreamPage, await self._run(self._redis.xrange(key, start, end, limit)))
            for _, fields in page:
                entry = _audit_entry(fields)
                if (since is None or entry.at >= since) and (until is None or entry.at < until):
                    entries.append(entry)
            if len(page) < limit:
                break
            ms, n = page[-1][0].split("-")
            start = f"{ms}-{int(n) + 1}"  # just after the last id read
        return entries[:limit]

    async def _versions(self, ids: builtins.list[str]) -> builtins.list[ModelVersion]:
        """The versions under ``ids``, in that order; one deleted meanwhile is left out."""
        if not ids:
            return []
        blobs = await self._run(self._redis.mget([self._version_key(i) for i in ids]))
        return [ModelVersion.from_dict(json.loads(blob)) for blob in blobs if blob is not None]

    def _version_key(self, version_id: str) -> str:
        return f"{self._p}version:{version_id}"

    def _versions_key(self) -> str:
        return f"{self._p}versions"

    def _ids_key(self) -> str:
        return f"{self._p}version_ids"

    def _alias_key(self, alias: str) -> str:
        return f"{self._p}alias:{alias}"

    def _policies_key(self) -> str:
        return f"{self._p}policies"

    def _revision_key(self) -> str:
        return f"{self._p}policy_revision"

    def _audit_key(self) -> str:
        return f"{self._p}audit"

    def _audit_alias_key(self, alias: str) -> str:
        return f"{self._p}audit:alias:{alias}"

    def _audit_seq_key(self) -> str:
        return f"{self._p}audit:seq"

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await bounded(call, self._deadline_s, "versions store")


def _ms(at: float) -> int:
    """Whole milliseconds of a time: nondecreasing in it, which the audit's ranges rely on."""
    return math.floor(at * 1000)


def _strs(values: Any) -> list[str]:
    """A reply of several strings as ``list[str]`` (redis-py types replies loosely)."""
    return [str(value) for value in values]


def _object(blob: str) -> dict[str, Any]:
    value = json.loads(blob)
    if not isinstance(value, dict):
        raise ValueError(f"stored JSON is not an object: {blob[:80]!r}")
    return value


def _audit_entry(fields: dict[str, str]) -> AuditEntry:
    data = json.loads(fields["data"])
    return AuditEntry.from_dict({**data, "seq": int(fields["seq"]), "at": float(fields["at"])})
