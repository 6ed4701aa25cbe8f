"""Who may call, through the real gateway: tenant keys on the OpenAI routes, the admin key on
``/admin/v1``, and the admin API's tenants, keys and usage as an operator drives them."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from admission.registry_sqlite import SqliteTenantRegistry
from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from tests.redis_server import Lookups, running_redis

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
CHAT = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
# Every replica's key cache follows a change within this long (the Authenticator's 0.5 s TTL
# and 0.4 s refresh-ahead, plus slack for one request's round trip; the gateway that made the
# change at once): the admin API promises changes take effect within a second.
PROPAGATION_S = 1.0


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[FakeStack]:
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        # Last-used times are written in batches; a short interval lets a test see one.
        key_touch_interval_s=0.05,
    )
    async with make_fake_stack(access=access) as fake_stack:
        yield fake_stack


async def _chat(stack: FakeStack, api_key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        return await http.post("/v1/chat/completions", json=CHAT, headers=headers)


def _error(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object, checked for the shape the SDKs parse."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["code"], str), "code is a string, never the status as an int"
    assert error["message"]
    return error


async def _refused_after(
    stack: FakeStack, api_key: str, status: int, changed_at: float
) -> httpx.Response:
    """Call until the answer has ``status``; check that no call sent ``PROPAGATION_S`` or more
    after ``changed_at`` (when the admin API confirmed the change) still got through.

    Send times, not answer times, are compared: a loaded machine makes answers slow, but a key
    is looked up after its request was sent, so a lookup older than the cache TTL is a bug.
    """
    deadline = time.monotonic() + 10
    while True:
        sent_at = time.monotonic()
        response = await _chat(stack, api_key)
        if response.status_code == status:
            return response
        late_s = sent_at - changed_at
        assert late_s < PROPAGATION_S, f"still {response.status_code} {late_s:.2f} s later"
        assert time.monotonic() < deadline, response.text


# -- the OpenAI routes -----------------------------------------------------------------------


async def test_missing_key_is_401_in_openai_shape(stack: FakeStack) -> None:
    response = await _chat(stack, None)
    assert response.status_code == 401
    error = _error(response)
    assert error["type"] == "authentication_error"
    assert error["code"] == "missing_api_key"
    assert "Authorization: Bearer" in error["message"]
    assert stack.decode.stats.num_requests == 0


async def test_malformed_authorization_header_counts_as_missing(stack: FakeStack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        response = await http.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": stack.api_key}
        )
    assert response.status_code == 401
    assert _error(response)["code"] == "missing_api_key"


async def test_wrong_key_is_401_and_never_echoed_whole(stack: FakeStack) -> None:
    wrong = "tdm-this-key-was-never-issued-0123456789"
    response = await _chat(stack, wrong)
    assert response.status_code == 401
    error = _error(response)
    assert error["code"] == "invalid_api_key"
    assert wrong not in error["message"], "the message redacts the key"
    # The official client maps it to its own exception class.
    async with stack.client_for(wrong) as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert caught.value.code == "invalid_api_key"


async def test_revoked_key_is_refused_within_a_second(stack: FakeStack) -> None:
    api_key = await stack.new_tenant("acme")
    # Used first, so the gateway holds it in its cache as valid when it is revoked.
    assert (await _chat(stack, api_key)).status_code == 200
    [key] = (await stack.admin.get("/admin/v1/tenants/acme/keys")).json()["data"]

    revoked = await stack.admin.post(f"/admin/v1/keys/{key['key_id']}/revoke")
    assert revoked.status_code == 200
    assert revoked.json()["revoked_at"] is not None

    response = await _refused_after(stack, api_key, 401, changed_at=time.monotonic())
    error = _error(response)
    assert error["code"] == "revoked_api_key"
    assert key["display_prefix"] in error["message"]
    # The tenant's other keys are untouched.
    fresh = (await stack.admin.post("/admin/v1/tenants/acme/keys", json={})).json()["key"]
    assert (await _chat(stack, fresh)).status_code == 200


async def test_revoking_an_unknown_key_is_404(stack: FakeStack) -> None:
    response = await stack.admin.post("/admin/v1/keys/key_0000/revoke")
    assert response.status_code == 404
    assert _error(response)["param"] == "key_id"


async def test_a_burst_on_a_cold_key_looks_it_up_once(tmp_path: Path) -> None:
    """Concurrent requests with a key the gateway has not cached share one registry lookup
    (the lookup scripts naming the key's hash, as the real Redis server ran them), instead of
    all asking the store at once."""
    with running_redis() as server:
        access = AccessConfig(
            admin_key=ADMIN_KEY,
            stores=StoreConfig(redis_url=server.url),
            key_touch_interval_s=3600,  # no last-used write of the key during the burst
        )
        async with make_fake_stack(access=access) as stack:
            api_key = await stack.new_tenant("acme")
            async with Lookups(server.url).watching() as watched:
                started = time.monotonic()
                responses = await asyncio.gather(*(_chat(stack, api_key) for _ in range(40)))
                elapsed = time.monotonic() - started
    assert [r.status_code for r in responses] == [200] * 40
    # One lookup per cache lifetime (0.5 s) that the burst spans, at most.
    lookups = watched.lookups_of(api_key)
    assert 1 <= lookups <= 1 + int(elapsed / 0.5), (lookups, elapsed)


# -- the admin credential --------------------------------------------------------------------


async def test_admin_api_refuses_tenant_keys_with_403(stack: FakeStack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        response = await http.get("/admin/v1/tenants", headers=stack.auth_headers)
    assert response.status_code == 403
    error = _error(response)
    assert error["type"] == "permission_denied"
    assert error["code"] == "permission_denied"


async def test_admin_api_without_or_with_a_wrong_admin_key_is_401(stack: FakeStack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        missing = await http.get("/admin/v1/tenants")
        wrong = await http.get(
            "/admin/v1/tenants", headers={"Authorization": f"Bearer {ADMIN_KEY}-not"}
        )
        # Every admin route is guarded, not only the listing.
        create = await http.post("/admin/v1/tenants", json={"name": "intruder"})
    for response in (missing, wrong, create):
        assert response.status_code == 401
        assert _error(response)["code"] == "invalid_admin_key"
    assert (await stack.admin.get("/admin/v1/tenants/intruder")).status_code == 404


async def test_admin_api_is_closed_without_an_admin_key(tmp_path: Path) -> None:
    access = AccessConfig(admin_key=None, stores=StoreConfig(sqlite_path=tmp_path / "t.db"))
    async with make_fake_stack(access=access) as stack:
        response = await stack.admin.get("/admin/v1/tenants")  # sends ADMIN_KEY
    assert response.status_code == 401
    error = _error(response)
    assert error["code"] == "admin_api_disabled"
    assert "TANDEM_ADMIN_KEY" in error["message"]


# -- tenants ---------------------------------------------------------------------------------


async def test_create_get_list_and_duplicate_tenant(stack: FakeStack) -> None:
    created = await stack.admin.post(
        "/admin/v1/tenants", json={"name": "acme", "tpm": 5000, "rpm": 60, "band": "interactive"}
    )
    assert created.status_code == 201
    tenant = created.json()
    assert tenant["name"] == "acme"
    assert tenant["tenant_id"].startswith("ten_")
    assert tenant["plan"] == {
        "tpm": 5000,
        "rpm": 60,
        "max_concurrent": None,
        "max_prompt_tokens": None,
        "max_output_tokens": None,
        "weight": 1.0,
        "band": "interactive",
        "moderation": None,
    }

    by_id = await stack.admin.get(f"/admin/v1/tenants/{tenant['tenant_id']}")
    by_name = await stack.admin.get("/admin/v1/tenants/acme")
    assert by_id.status_code == by_name.status_code == 200
    assert by_id.json() == by_name.json() == tenant

    duplicate = await stack.admin.post("/admin/v1/tenants", json={"name": "acme"})
    assert duplicate.status_code == 409
    error = _error(duplicate)
    assert (error["code"], error["param"]) == ("tenant_exists", "name")

    listed = (await stack.admin.get("/admin/v1/tenants")).json()
    assert listed["object"] == "list"
    assert [t["name"] for t in listed["data"]] == ["acme", "default"]
    assert next(t for t in listed["data"] if t["name"] == "acme") == tenant

    missing = await stack.admin.get("/admin/v1/tenants/nobody")
    assert missing.status_code == 404
    assert _error(missing)["param"] == "tenant"


async def test_patch_keeps_omitted_fields_and_null_means_unlimited(stack: FakeStack) -> None:
    await stack.new_tenant("acme", tpm=5000, rpm=60, max_output_tokens=100, weight=2.0)

    patched = await stack.admin.patch("/admin/v1/tenants/acme", json={"rpm": 10, "tpm": None})
    assert patched.status_code == 200
    plan = patched.json()["plan"]
    assert plan["rpm"] == 10
    assert plan["tpm"] is None, "explicit null is unlimited"
    assert plan["max_output_tokens"] == 100, "omitted fields keep their values"
    assert plan["weight"] == 2.0
    assert (await stack.admin.get("/admin/v1/tenants/acme")).json()["plan"] == plan

    unchanged = await stack.admin.patch("/admin/v1/tenants/acme", json={})
    assert unchanged.json()["plan"] == plan
    missing = await stack.admin.patch("/admin/v1/tenants/nobody", json={"rpm": 1})
    assert missing.status_code == 404


async def test_a_plan_change_applies_to_requests_within_a_second(stack: FakeStack) -> None:
    api_key = await stack.new_tenant("acme")
    assert (await _chat(stack, api_key)).status_code == 200  # cached with the unlimited plan

    patched = await stack.admin.patch("/admin/v1/tenants/acme", json={"max_output_tokens": 2})
    assert patched.status_code == 200

    response = await _refused_after(stack, api_key, 400, changed_at=time.monotonic())
    assert _error(response)["code"] == "max_tokens_too_large"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"name": "acme", "tpm": 0}, "tpm"),
        ({"name": "acme", "rpm": -5}, "rpm"),
        ({"name": "acme", "rpm": "lots"}, "rpm"),
        ({"name": "acme", "band": "urgent"}, "band"),
        ({"name": "acme", "weight": 0}, "weight"),
        ({"name": "Bad Name!"}, "name"),
        ({"name": ""}, "name"),
        ({"tpm": 10}, "name"),
        ({"name": "acme", "tmp": 10}, "tmp"),  # a typo is refused, not silently ignored
    ],
)
async def test_invalid_tenant_bodies_are_400_naming_the_field(
    stack: FakeStack, body: dict[str, Any], param: str
) -> None:
    response = await stack.admin.post("/admin/v1/tenants", json=body)
    assert response.status_code == 400
    error = _error_without_code(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert param in error["message"]
    assert (await stack.admin.get("/admin/v1/tenants/acme")).status_code == 404


async def test_invalid_patch_is_400_and_changes_nothing(stack: FakeStack) -> None:
    await stack.new_tenant("acme", tpm=5000)
    before = (await stack.admin.get("/admin/v1/tenants/acme")).json()
    for body, param in (({"tpm": 0}, "tpm"), ({"band": "vip"}, "band"), ({"name": "x"}, "name")):
        response = await stack.admin.patch("/admin/v1/tenants/acme", json=body)
        assert response.status_code == 400, body
        assert _error_without_code(response)["param"] == param
    assert (await stack.admin.get("/admin/v1/tenants/acme")).json() == before


def _error_without_code(response: httpx.Response) -> dict[str, Any]:
    """A validation error: OpenAI's shape with ``code`` null (it is a string or null)."""
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] is None or isinstance(error["code"], str)
    return error


async def test_deleting_a_tenant_stops_its_keys(stack: FakeStack) -> None:
    api_key = await stack.new_tenant("acme", rpm=100)
    assert (await _chat(stack, api_key)).status_code == 200
    tenant_id = (await stack.admin.get("/admin/v1/tenants/acme")).json()["tenant_id"]

    deleted = await stack.admin.delete("/admin/v1/tenants/acme")
    changed_at = time.monotonic()
    assert deleted.status_code == 200
    assert deleted.json() == {"id": tenant_id, "object": "tenant", "deleted": True}

    response = await _refused_after(stack, api_key, 401, changed_at=changed_at)
    assert _error(response)["code"] == "invalid_api_key"
    assert (await stack.admin.get("/admin/v1/tenants/acme")).status_code == 404
    assert (await stack.admin.get("/admin/v1/tenants/acme/keys")).status_code == 404
    assert (await stack.admin.delete("/admin/v1/tenants/acme")).status_code == 404
    # The name is free again, and the new tenant starts with full quotas, not the old counters.
    await stack.new_tenant("acme", rpm=100)
    usage = (await stack.admin.get("/admin/v1/tenants/acme/usage")).json()
    assert usage["requests"]["remaining"] == 100


# -- keys ------------------------------------------------------------------------------------


async def test_issued_key_is_shown_once_and_never_listed(stack: FakeStack) -> None:
    await stack.new_tenant("acme")
    issued = await stack.admin.post("/admin/v1/tenants/acme/keys", json={"name": "ci"})
    assert issued.status_code == 201
    key = issued.json()
    plaintext = key["key"]
    assert plaintext.startswith("tdm-")
    assert key["name"] == "ci"
    assert key["display_prefix"] == plaintext[:12]
    assert key["revoked_at"] is None and key["last_used_at"] is None

    listed = await stack.admin.get("/admin/v1/tenants/acme/keys")
    assert listed.status_code == 200
    assert [k["name"] for k in listed.json()["data"]] == ["default", "ci"]
    assert all("key" not in k for k in listed.json()["data"])
    assert plaintext not in listed.text
    # Nor anywhere else the admin API shows the tenant.
    for path in ("/admin/v1/tenants", "/admin/v1/tenants/acme", "/admin/v1/tenants/acme/usage"):
        assert plaintext not in (await stack.admin.get(path)).text

    assert (await _chat(stack, plaintext)).status_code == 200
    missing = await stack.admin.post("/admin/v1/tenants/nobody/keys", json={})
    assert missing.status_code == 404


async def test_last_used_at_is_recorded_after_a_request(stack: FakeStack) -> None:
    api_key = await stack.new_tenant("acme")
    before = time.time()
    assert (await _chat(stack, api_key)).status_code == 200
    after = time.time()
    last_used: list[float | None] = [None]

    async def fetch() -> None:
        [key] = (await stack.admin.get("/admin/v1/tenants/acme/keys")).json()["data"]
        last_used[0] = key["last_used_at"]

    deadline = time.monotonic() + 5
    while last_used[0] is None and time.monotonic() < deadline:
        await fetch()
    assert last_used[0] is not None, "last_used_at was never written"
    assert before <= last_used[0] <= after


async def test_last_used_at_is_flushed_when_the_gateway_stops(tmp_path: Path) -> None:
    # The default 5 s interval never fires here: only the flush on shutdown can write it.
    path = tmp_path / "tandem.db"
    access = AccessConfig(admin_key=ADMIN_KEY, stores=StoreConfig(sqlite_path=path))
    async with make_fake_stack(access=access) as stack:
        assert (await _chat(stack, stack.api_key)).status_code == 200
        [key] = (await stack.admin.get("/admin/v1/tenants/default/keys")).json()["data"]
        assert key["last_used_at"] is None
    registry = SqliteTenantRegistry(path)
    try:
        [stored] = await registry.list_keys(key["tenant_id"])
    finally:
        await registry.aclose()
    assert stored.key_id == key["key_id"]
    assert stored.last_used_at is not None


# -- usage -----------------------------------------------------------------------------------


async def test_usage_shows_tokens_dropping_and_requests_in_flight(stack: FakeStack) -> None:
    # Slow buckets (2 tokens/s, 1 request/min), so refills cannot blur what was taken.
    tpm, max_tokens = 120, 50
    api_key = await stack.new_tenant("acme", tpm=tpm, rpm=1)
    idle = (await stack.admin.get("/admin/v1/tenants/acme/usage")).json()
    assert idle["name"] == "acme"
    assert idle["plan"]["tpm"] == tpm
    assert idle["tokens"] == {"limit_per_minute": tpm, "remaining": tpm, "reset_s": 0.0}
    assert idle["requests"] == {"limit_per_minute": 1, "remaining": 1, "reset_s": 0.0}
    assert idle["concurrent"] == 0 and idle["queued_here"] == 0

    stack.decode.token_delay_s = 0.05
    sent_at = time.monotonic()
    async with stack.client_for(api_key) as client:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for _ in stream:
            break
        running = (await stack.admin.get("/admin/v1/tenants/acme/usage")).json()
        assert running["concurrent"] == 1
        assert running["requests"]["remaining"] == 0
        assert running["requests"]["reset_s"] > 0
        # While it runs, the whole estimate is reserved: prompt (about 15) plus max_tokens.
        assert running["tokens"]["remaining"] <= tpm - max_tokens + _refill(tpm, sent_at)
        assert running["tokens"]["reset_s"] > 0
        stack.decode.token_delay_s = 0.0
        chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None
    used = chunks[-1].usage.total_tokens
    # A stream is settled just after its last byte: the client may ask before that.
    deadline = time.monotonic() + 5
    while (done := (await stack.admin.get("/admin/v1/tenants/acme/usage")).json())["concurrent"]:
        assert time.monotonic() < deadline, "the stream's slot was never released"
        await asyncio.sleep(0.02)
    # Settled to what the engine reported: the unused part of max_tokens came back.
    assert tpm - used <= done["tokens"]["remaining"] <= tpm - used + _refill(tpm, sent_at)
    assert (await stack.admin.get("/admin/v1/tenants/nobody/usage")).status_code == 404


def _refill(per_minute: int, since: float) -> int:
    """The most a bucket can have refilled since ``since`` (monotonic seconds)."""
    return math.ceil((time.monotonic() - since) * per_minute / 60)


# -- documentation ---------------------------------------------------------------------------


async def test_openapi_documents_the_admin_routes(stack: FakeStack) -> None:
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        response = await http.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    paths = schema["paths"]
    expected = {
        "/admin/v1/tenants": {"get", "post"},
        "/admin/v1/tenants/{tenant}": {"get", "patch", "delete"},
        "/admin/v1/tenants/{tenant}/keys": {"get", "post"},
        "/admin/v1/keys/{key_id}/revoke": {"post"},
        "/admin/v1/tenants/{tenant}/usage": {"get"},
    }
    for path, methods in expected.items():
        assert path in paths, path
        assert set(paths[path]) >= methods, path
        for method in methods:
            operation = paths[path][method]
            assert operation["tags"] == ["admin"]
            assert operation.get("description"), f"{method} {path} has no description"
    create = paths["/admin/v1/tenants"]["post"]
    ref = create["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert body["required"] == ["name"]
    assert {"name", "tpm", "rpm", "max_concurrent", "band", "weight"} <= set(body["properties"])
    # The field docs reach the schema, so an operator reading /docs sees what each limit means.
    assert "minute" in json.dumps(body["properties"]["tpm"]).lower()
