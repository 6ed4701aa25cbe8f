"""``TenantRegistry`` in Redis, shared by every gateway replica pointed at the same server.

Keys (``<p>`` is ``key_prefix``):

- ``<p>tenant:<tenant_id>``       string: the tenant as ``tenant_to_dict`` JSON
- ``<p>tenants``                  set of tenant ids
- ``<p>tenant_name:<name>``       string: the tenant id (``SET NX`` makes names unique across
  replicas)
- ``<p>key:<key_id>``             hash: ``data`` (the key as ``key_to_dict`` JSON, as issued),
  ``revoked_at`` and ``last_used_at`` (Unix seconds as ``repr(float)``, absent until set)
- ``<p>key_hash:<sha256>``        string: the key id
- ``<p>tenant_keys:<tenant_id>``  set of key ids

The two mutable times of a key live in their own hash fields, so scripts update them with
``HSETNX``/compare-and-set and never re-encode the JSON: Lua's cjson writes numbers with 14
significant digits, which would round every stored timestamp.

Every change spanning several keys is one Lua script, hence atomic. The scripts of
``delete_tenant`` and ``lookup_key`` reach keys they compute from the prefix, so on Redis Cluster
the prefix must carry a hash tag (``{tandem}:``) to keep the whole registry in one slot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from admission.plan_codec import key_from_dict, key_to_dict, tenant_from_dict, tenant_to_dict
from admission.plans import Plan
from admission.redis_conn import bounded, connect
from admission.registry import TenantExistsError, UnknownKeyError, UnknownTenantError
from admission.tenants import (
    ApiKey,
    IssuedKey,
    Tenant,
    display_prefix,
    hash_key,
    new_id,
    new_key_secret,
)

_T = TypeVar("_T")

# KEYS: name index, tenant, tenants set. ARGV: tenant id, tenant JSON. Reply: 1, or 0 (name taken).
_CREATE_TENANT = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""

# KEYS: tenant, tenants set, tenant's key set. ARGV: prefix, tenant id. Reply: 1, or 0 (unknown).
_DELETE_TENANT = """
local tenant = redis.call('GET', KEYS[1])
if not tenant then return 0 end
local name_key = ARGV[1] .. 'tenant_name:' .. cjson.decode(tenant)['name']
if redis.call('GET', name_key) == ARGV[2] then redis.call('DEL', name_key) end
for _, key_id in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local key = ARGV[1] .. 'key:' .. key_id
  local data = redis.call('HGET', key, 'data')
  if data then redis.call('DEL', ARGV[1] .. 'key_hash:' .. cjson.decode(data)['key_hash']) end
  redis.call('DEL', key)
end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('SREM', KEYS[2], ARGV[2])
return 1
"""

# KEYS: tenant, key, hash index, tenant's key set. ARGV: key id, key JSON.
# Reply: 1, or 0 (unknown tenant: checked here so a concurrent delete cannot orphan the key).
_ISSUE_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[2], 'data', ARGV[2])
redis.call('SET', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[4], ARGV[1])
return 1
"""

# KEYS: key. ARGV: now. Reply: {data, revoked_at, last_used_at}, or nil (unknown key).
_REVOKE_KEY = """
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
redis.call('HSETNX', KEYS[1], 'revoked_at', ARGV[1])
return redis.call('HMGET', KEYS[1], 'data', 'revoked_at', 'last_used_at')
"""

# KEYS: hash index. ARGV: prefix. Reply: {data, revoked_at, last_used_at, tenant JSON}, or nil.
_LOOKUP_KEY = """
local key_id = redis.call('GET', KEYS[1])
if not key_id then return false end
local key = redis.call('HMGET', ARGV[1] .. 'key:' .. key_id, 'data', 'revoked_at', 'last_used_at')
if not key[1] then return false end
local tenant = redis.call('GET', ARGV[1] .. 'tenant:' .. cjson.decode(key[1])['tenant_id'])
if not tenant then return false end
return {key[1], key[2], key[3], tenant}
"""

# KEYS: keys. ARGV: a time per key. Skips unknown keys and times older than the stored one
# (tonumber parses both sides to the same doubles Python wrote).
_TOUCH_KEYS = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    local current = redis.call('HGET', key, 'last_used_at')
    if not current or tonumber(current) < tonumber(ARGV[i]) then
      redis.call('HSET', key, 'last_used_at', ARGV[i])
    end
  end
end
return 0
"""

_KEY_FIELDS = ("data", "revoked_at", "last_used_at")


class RedisTenantRegistry:
    """Tenants and keys in Redis. Construction does no I/O; connections open on first use."""

    def __init__(self, url: str, *, key_prefix: str = "tandem:", timeout_s: float = 0.5) -> None:
        self._redis = connect(url, timeout_s)  # see admission/redis_conn.py
        self._p = key_prefix
        # Bounds one round trip (connect, EVALSHA, the script-cache fallback after a restart),
        # where the socket timeouts bound each operation alone.
        self._deadline_s = 2 * timeout_s
        self._create_tenant = self._redis.register_script(_CREATE_TENANT)
        self._delete_tenant = self._redis.register_script(_DELETE_TENANT)
        self._issue_key = self._redis.register_script(_ISSUE_KEY)
        self._revoke_key = self._redis.register_script(_REVOKE_KEY)
        self._lookup_key = self._redis.register_script(_LOOKUP_KEY)
        self._touch_keys = self._redis.register_script(_TOUCH_KEYS)

    async def create_tenant(self, name: str, plan: Plan) -> Tenant:
        """Create a tenant; ``TenantExistsError`` if the name is taken."""
        now = time.time()
        tenant = Tenant(new_id("ten"), name, plan, created_at=now, updated_at=now)
        keys = [self._name_key(name), self._tenant_key(tenant.tenant_id), self._tenants_key()]
        args = [tenant.tenant_id, json.dumps(tenant_to_dict(tenant))]
        if int(await self._run(self._create_tenant(keys, args))) == 0:
            raise TenantExistsError(name)
        return tenant

    async def list_tenants(self) -> list[Tenant]:
        """Every tenant, ordered by name."""
        ids = [str(i) for i in await self._run(self._redis.smembers(self._tenants_key()))]
        if not ids:
            return []
        blobs = await self._run(self._redis.mget([self._tenant_key(i) for i in ids]))
        # A tenant deleted between the two reads is simply not listed.
        tenants = [tenant_from_dict(json.loads(blob)) for blob in blobs if blob is not None]
        return sorted(tenants, key=lambda tenant: tenant.name)

    async def get_tenant(self, tenant_id: str) -> Tenant | None:
        """One tenant by id."""
        blob = await self._run(self._redis.get(self._tenant_key(tenant_id)))
        return None if blob is None else tenant_from_dict(json.loads(blob))

    async def find_tenant(self, name: str) -> Tenant | None:
        """One tenant by name."""
        tenant_id = await self._run(self._redis.get(self._name_key(name)))
        if tenant_id is None:
            return None
        tenant = await self.get_tenant(str(tenant_id))
        # The name may have been deleted and taken again between the two reads.
        return tenant if tenant is not None and tenant.name == name else None

    async def update_tenant(self, tenant_id: str, plan: Plan) -> Tenant:
        """Replace a tenant's plan; ``UnknownTenantError`` if there is none."""
        current = await self.get_tenant(tenant_id)
        if current is None:
            raise UnknownTenantError(tenant_id)
        tenant = Tenant(tenant_id, current.name, plan, current.created_at, updated_at=time.time())
        # XX: a tenant deleted since the read stays deleted. Name and creation time never
        # change, so a concurrent update loses nothing but its own plan (last write wins).
        blob = json.dumps(tenant_to_dict(tenant))
        if not await self._run(self._redis.set(self._tenant_key(tenant_id), blob, xx=True)):
            raise UnknownTenantError(tenant_id)
        return tenant

    async def delete_tenant(self, tenant_id: str) -> None:
        """Delete a tenant and every key of it; ``UnknownTenantError`` if there is none."""
        keys = [self._tenant_key(tenant_id), self._tenants_key(), self._tenant_keys_key(tenant_id)]
        if int(await self._run(self._delete_tenant(keys, [self._p, tenant_id]))) == 0:
            raise UnknownTenantError(tenant_id)

    async def issue_key(self, tenant_id: str, name: str) -> IssuedKey:
        """A new key for a tenant; ``UnknownTenantError`` if there is none."""
        plaintext = new_key_secret()
        key = ApiKey(
            key_id=new_id("key"),
            tenant_id=tenant_id,
            name=name,
            display_prefix=display_prefix(plaintext),
            key_hash=hash_key(plaintext),
            created_at=time.time(),
        )
        keys = [
            self._tenant_key(tenant_id),
            self._key_key(key.key_id),
            self._hash_key(key.key_hash),
            self._tenant_keys_key(tenant_id),
        ]
        args = [key.key_id, json.dumps(key_to_dict(key))]
        if int(await self._run(self._issue_key(keys, args))) == 0:
            raise UnknownTenantError(tenant_id)
        return IssuedKey(key=key, plaintext=plaintext)

    async def list_keys(self, tenant_id: str) -> list[ApiKey]:
        """A tenant's keys, revoked ones included, oldest first (none for an unknown tenant)."""
        key_ids = await self._run(self._redis.smembers(self._tenant_keys_key(tenant_id)))
        if not key_ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for key_id in key_ids:
                pipe.hmget(self._key_key(str(key_id)), _KEY_FIELDS)
            replies: list[list[str | None]] = await self._run(pipe.execute())
        keys = [_key(reply) for reply in replies if reply[0] is not None]
        return sorted(keys, key=lambda key: (key.created_at, key.key_id))

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key (idempotent: the first revocation time is kept);
        ``UnknownKeyError`` if there is none."""
        reply = await self._run(self._revoke_key([self._key_key(key_id)], [repr(time.time())]))
        if reply is None:
            raise UnknownKeyError(key_id)
        return _key(reply)

    async def lookup_key(self, key_hash: str) -> tuple[ApiKey, Tenant] | None:
        """The key with that hash and its tenant (revoked keys included: the caller decides)."""
        reply = await self._run(self._lookup_key([self._hash_key(key_hash)], [self._p]))
        if reply is None:
            return None
        return _key(reply[:3]), tenant_from_dict(json.loads(reply[3]))

    async def touch_keys(self, last_used: dict[str, float]) -> None:
        """Record last-used times (key id -> Unix seconds), batched by the caller; a time
        never moves backwards. Unknown (deleted) keys are skipped. One round trip."""
        if not last_used:
            return
        keys = [self._key_key(key_id) for key_id in last_used]
        args = [repr(float(at)) for at in last_used.values()]
        await self._run(self._touch_keys(keys, args))

    async def aclose(self) -> None:
        """Release the connections."""
        await self._redis.aclose()

    def _tenant_key(self, tenant_id: str) -> str:
        return f"{self._p}tenant:{tenant_id}"

    def _tenants_key(self) -> str:
        return f"{self._p}tenants"

    def _name_key(self, name: str) -> str:
        return f"{self._p}tenant_name:{name}"

    def _key_key(self, key_id: str) -> str:
        return f"{self._p}key:{key_id}"

    def _hash_key(self, key_hash: str) -> str:
        return f"{self._p}key_hash:{key_hash}"

    def _tenant_keys_key(self, tenant_id: str) -> str:
        return f"{self._p}tenant_keys:{tenant_id}"

    async def _run(self, call: Awaitable[_T]) -> _T:
        return await bounded(call, self._deadline_s, "tenant registry")


def _key(fields: Sequence[Any]) -> ApiKey:
    """An ``ApiKey`` from its hash fields ``data``, ``revoked_at``, ``last_used_at``."""
    data, revoked_at, last_used_at = fields
    record = json.loads(data)
    record["revoked_at"] = None if revoked_at is None else float(revoked_at)
    record["last_used_at"] = None if last_used_at is None else float(last_used_at)
    return key_from_dict(record)
