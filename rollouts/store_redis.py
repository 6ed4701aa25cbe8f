"""``RolloutStore`` in Redis, shared by every gateway replica pointed at the same server.

Keys (``<p>`` is ``key_prefix``):

- ``<p>rollout:<id>``      string: the record as JSON
- ``<p>rollouts``          sorted set: rollout ids by ``created_at`` at create (listing, newest
  first; a score never changes)
- ``<p>alias:<alias>``     sorted set: the alias's rollout ids, scored alike
- ``<p>active``            sorted set: the ids of the active rollouts, scored alike
- ``<p>active:<alias>``    string: the id of the alias's active rollout (absent: none)
- ``<p>fence``             string: the highest fencing token any save has used (absent: 0)
- ``<p>commands:<id>``     list: the rollout's commands as JSON, oldest first; never trimmed,
  so a command's seq is its position (1, 2, 3...), the length ``RPUSH`` answers

Create, save and push are one Lua script each, hence atomic; the scripts get the record's
active-ness from Python (``ACTIVE_STATUSES`` lives in one place) and keep ``<p>active:<alias>``
and ``<p>active`` in step with the record. JSON is written by Python only and passes through the
scripts as opaque strings: Lua's cjson keeps 14 significant digits and would round times (save
decodes the stored record only to read its alias). Every key a script touches is passed in
``KEYS``, so on Redis Cluster the prefix must carry a hash tag (``{tandem}:``) for them to share
a slot.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable
from typing import Any, TypeVar

from admission.redis_conn import bounded, connect
from rollouts.store import (
    RecordKeys,
    active_conflict,
    alias_changed,
    check_count,
    check_fence,
    dump,
    fenced_out,
    id_taken,
    load,
    record_keys,
    unknown,
)

_T = TypeVar("_T")

_PAGE = 100
"""Ids read per round trip while a filtered listing looks for ``limit`` matches."""

# KEYS: record, rollouts, alias set, active set, active pointer.
# ARGV: id, record JSON, created_at (repr), '1' if the record is active else '0'.
# Reply: {'ok'}, {'conflict', active id} or {'exists'}.
_CREATE = """
local active_id = redis.call('GET', KEYS[5])
if active_id then return {'conflict', active_id} end
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[3], ARGV[1])
if ARGV[4] == '1' then
  redis.call('ZADD', KEYS[4], ARGV[3], ARGV[1])
  redis.call('SET', KEYS[5], ARGV[1])
end
return {'ok'}
"""

# KEYS: record, rollouts, alias set, active set, active pointer, fence.
# ARGV: id, record JSON, '1' if active else '0', fence, alias.
# Reply: {'ok'}, {'fenced', highest}, {'unknown'}, {'alias', stored alias} or
# {'conflict', active id}. Every check comes before the first write: a refused save changes
# nothing. A rollout keeps the place in the listings it was created with (its first
# created_at), so the sets' scores never change and listings can page by offset.
_SAVE = """
local highest = redis.call('GET', KEYS[6]) or '0'
if tonumber(ARGV[4]) < tonumber(highest) then return {'fenced', highest} end
local blob = redis.call('GET', KEYS[1])
if not blob then return {'unknown'} end
local alias = cjson.decode(blob)['alias']
if alias ~= ARGV[5] then return {'alias', alias} end
local active_id = redis.call('GET', KEYS[5])
if ARGV[3] == '1' then
  if active_id and active_id ~= ARGV[1] then return {'conflict', active_id} end
  redis.call('SET', KEYS[5], ARGV[1])
  redis.call('ZADD', KEYS[4], redis.call('ZSCORE', KEYS[2], ARGV[1]), ARGV[1])
else
  if active_id == ARGV[1] then redis.call('DEL', KEYS[5]) end
  redis.call('ZREM', KEYS[4], ARGV[1])
end
redis.call('SET', KEYS[6], ARGV[4])
redis.call('SET', KEYS[1], ARGV[2])
return {'ok'}
"""

# KEYS: fence. ARGV: fence. Raises the highest fence, never lowers it.
_ADVANCE_FENCE = """
local highest = redis.call('GET', KEYS[1]) or '0'
if tonumber(ARGV[1]) > tonumber(highest) then redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""

# KEYS: record, commands. ARGV: command JSON. Reply: its seq, or 0 (no such rollout).
_PUSH = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
return redis.call('RPUSH', KEYS[2], ARGV[1])
"""


class RedisRolloutStore:
    """Rollouts, their commands and the fence in Redis; see the module docstring for the keys.
    Construction does no I/O; connections open on first use (or ``start()``)."""

    def __init__(
        self, url: str, *, timeout_s: float = 2.0, key_prefix: str = "tandem:rollouts:"
    ) -> None:
        self._redis = connect(url, timeout_s)  # see admission/redis_conn.py
        self._p = key_prefix
        # Bounds one round trip (connect, EVALSHA, the script-cache fallback after a restart),
        # where the socket timeouts bound each operation alone.
        self._deadline_s = 2 * timeout_s
        self._create = self._redis.register_script(_CREATE)
        self._save = self._redis.register_script(_SAVE)
        self._push = self._redis.register_script(_PUSH)
        self._advance_fence = self._redis.register_script(_ADVANCE_FENCE)

    async def start(self) -> None:
        """Reach the server now (one ``PING``); ``StoreUnavailable`` if it does not answer."""
        await self._run(self._redis.ping())

    async def aclose(self) -> None:
        """Release the connections."""
        await self._redis.aclose()

    async def create(self, record: dict[str, Any]) -> None:
        """Store a new rollout; ``RolloutConflictError`` if its alias has an active one or its
        id is taken. One round trip."""
        keys = record_keys(record)
        args = [keys.id, dump(record), repr(keys.created_at), _flag(keys)]
        reply = await self._run(self._create(self._record_keys(keys), args))
        if reply[0] == "conflict":
            raise active_conflict(keys.alias, str(reply[1]))
        if reply[0] == "exists":
            raise id_taken(keys.id)

    async def get(self, rollout_id: str) -> dict[str, Any] | None:
        """The record of ``rollout_id``, if there is one."""
        blob = await self._run(self._redis.get(self._record_key(rollout_id)))
        return None if blob is None else load(str(blob))

    async def list(
        self, *, alias: str | None = None, active: bool | None = None, limit: int = 100
    ) -> builtins.list[dict[str, Any]]:
        """Up to ``limit`` records, newest first (ties: greater id first), of ``alias`` and
        active or finished if asked."""
        check_count("limit", limit)
        if active and alias is not None:
            # One key read: the alias has at most one active rollout.
            active_id = await self._run(self._redis.get(self._active_key(alias)))
            ids = [] if active_id is None else [str(active_id)]
            return [r for r in await self._records(ids) if _matches(r, alias, active)][:limit]
        if active:
            # Whole: it holds at most one rollout per alias.
            ids = _strs(
                await self._run(self._redis.zrange(self._active_set_key(), 0, -1, desc=True))
            )
            return [r for r in await self._records(ids) if _matches(r, alias, active)][:limit]
        key = self._rollouts_key() if alias is None else self._alias_key(alias)
        found: list[dict[str, Any]] = []
        seen: set[str] = set()
        start = 0
        while len(found) < limit:
            # Ids never leave these sets and their scores never change; a rollout created
            # meanwhile can only push ids to a later page, so an id may come twice (hence
            # ``seen``) but none is skipped.
            page = _strs(
                await self._run(self._redis.zrange(key, start, start + _PAGE - 1, desc=True))
            )
            fresh = [i for i in page if i not in seen]
            seen.update(fresh)
            found.extend(r for r in await self._records(fresh) if _matches(r, alias, active))
            if len(page) < _PAGE:
                break
            start += _PAGE
        return found[:limit]

    async def save(self, record: dict[str, Any], fence: int) -> None:
        """Replace the stored record if ``fence`` is not stale; see ``RolloutStore.save``. One
        round trip."""
        keys = record_keys(record)
        check_fence(fence)
        script_keys = [*self._record_keys(keys), self._fence_key()]
        args = [keys.id, dump(record), _flag(keys), str(fence), keys.alias]
        reply = await self._run(self._save(script_keys, args))
        match reply[0]:
            case "fenced":
                raise fenced_out(fence, int(reply[1]))
            case "unknown":
                raise unknown(keys.id)
            case "alias":
                raise alias_changed(keys.id, str(reply[1]), keys.alias)
            case "conflict":
                raise active_conflict(keys.alias, str(reply[1]))

    async def advance_fence(self, fence: int) -> None:
        """Raise the highest fence to ``fence``; see ``RolloutStore.advance_fence``."""
        check_fence(fence)
        await self._run(self._advance_fence([self._fence_key()], [str(fence)]))

    async def push_command(self, rollout_id: str, command: dict[str, Any]) -> int:
        """Append ``command`` to the rollout's log; its seq. ``UnknownRolloutError`` if there
        is no such rollout. One round trip."""
        keys = [self._record_key(rollout_id), self._commands_key(rollout_id)]
        seq = int(await self._run(self._push(keys, [dump(command)])))
        if seq == 0:
            raise unknown(rollout_id)
        return seq

    async def commands(
        self, rollout_id: str, after_seq: int = 0
    ) -> builtins.list[tuple[int, dict[str, Any]]]:
        """The rollout's commands with seq greater than ``after_seq``, oldest first."""
        check_count("after_seq", after_seq)
        # Seq n sits at index n - 1: the first one after ``after_seq`` at index ``after_seq``.
        blobs = _strs(
            await self._run(self._redis.lrange(self._commands_key(rollout_id), after_seq, -1))
        )
        return [(after_seq + n, load(blob)) for n, blob in enumerate(blobs, start=1)]

    async def _records(self, ids: builtins.list[str]) -> builtins.list[dict[str, Any]]:
        """The records under ``ids``, in that order."""
        if not ids:
            return []
        blobs = await self._run(self._redis.mget([self._record_key(i) for i in ids]))
        return [load(str(blob)) for blob in blobs if blob is not None]

    def _record_keys(self, keys: RecordKeys) -> builtins.list[str]:
        """The keys create and save change, in the order their scripts read them."""
        return [
            self._record_key(keys.id),
            self._rollouts_key(),
            self._alias_key(keys.alias),
            self._active_set_key(),
            self._active_key(keys.alias),
        ]

    def _record_key(self, rollout_id: str) -> str:
        return f"{self._p}rollout:{rollout_id}"

    def _rollouts_key(self) -> str:
        return f"{self._p}rollouts"

    def _alias_key(self, alias: str) -> str:
        return f"{self._p}alias:{alias}"

    def _active_set_key(self) -> str:
        return f"{self._p}active"

    def _active_key(self, alias: str) -> str:
        return f"{self._p}active:{alias}"

    def _fence_key(self) -> str:
        return f"{self._p}fence"

    def _commands_key(self, rollout_id: str) -> str:
        return f"{self._p}commands:{rollout_id}"

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await bounded(call, self._deadline_s, "rollout store")


def _flag(keys: RecordKeys) -> str:
    return "1" if keys.active else "0"


def _matches(record: dict[str, Any], alias: str | None, active: bool | None) -> bool:
    """Whether a record read back belongs in a listing (its status may have changed since
    its id was read)."""
    if alias is not None and record.get("alias") != alias:
        return False
    return active is None or record_keys(record).active == active


def _strs(values: Any) -> list[str]:
    """A reply of several strings as ``list[str]`` (redis-py types replies loosely)."""
    return [str(value) for value in values]
