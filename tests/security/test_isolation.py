"""Tenant isolation through the real gateway: a tenant's key reads its own usage and ledger rows
only, never replays or even detects another tenant's idempotent answers, cannot read a request
log, and is refused (403) by every admin route, enumerated from the app itself so a route added
later is covered too."""

from __future__ import annotations

import csv
import io
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from gateway.assembly.app import AccessConfig, GatewayConfig, create_app
from gateway.assembly.stores import StoreConfig
from gateway.auth_throttle import AuthThrottleConfig
from gateway.serving.upstream import UpstreamConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from workers.deployments import Deployments

REPLAYED = "idempotent-replayed"


@dataclass(frozen=True)
class Tenant:
    name: str
    tenant_id: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


PROXY = "127.0.0.9"
"""A proxy the gateway trusts: through it, tests reach the gateway as clients off this host."""


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FakeStack]:
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path_factory.mktemp("isolation") / "tandem.db"),
        auth_throttle=AuthThrottleConfig(trusted_proxies=(PROXY,)),
    )
    async with make_fake_stack(access=access) as fake_stack:
        yield fake_stack


@pytest.fixture(scope="module")
async def http(stack: FakeStack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as client:
        yield client


async def _tenant(stack: FakeStack, name: str) -> Tenant:
    key = await stack.new_tenant(name)
    tenant_id = (await stack.admin.get(f"/admin/v1/tenants/{name}")).json()["tenant_id"]
    return Tenant(name, tenant_id, key)


async def _chat(
    http: httpx.AsyncClient, tenant: Tenant, text: str, idempotency_key: str | None = None
) -> httpx.Response:
    headers = dict(tenant.headers)
    if idempotency_key is not None:
        headers["Idempotency-Key"] = idempotency_key
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    response = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    return response


async def _usage(http: httpx.AsyncClient, caller: Tenant, **params: str) -> httpx.Response:
    response = await http.get("/v1/usage", headers=caller.headers, params=params)
    assert response.status_code == 200, response.text
    return response


async def test_usage_and_ledger_rows_are_the_callers_own(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    a, b = await _tenant(stack, "usage-a"), await _tenant(stack, "usage-b")
    for i in range(3):
        await _chat(http, a, f"a's question {i}")
    await _chat(http, b, "b's question")

    own_a = (await _usage(http, a)).json()
    assert (own_a["tenant_id"], own_a["total"]["requests"]) == (a.tenant_id, 3)
    # Asking for the other tenant by name or id changes nothing: the key decides.
    for params in ({}, {"tenant": a.name}, {"tenant": a.tenant_id}, {"tenant_id": a.tenant_id}):
        response = await _usage(http, b, **params)
        assert a.tenant_id not in response.text
        assert (response.json()["tenant_id"], response.json()["total"]["requests"]) == (
            b.tenant_id,
            1,
        )
    # The ledger's own rows, in every export format.
    period = {"from": "2000-01-01", "to": "2100-01-01", "kind": "requests"}
    rows = list(csv.DictReader(io.StringIO((await _usage(http, b, **period, format="csv")).text)))
    assert [row["tenant_id"] for row in rows] == [b.tenant_id]
    for fmt in ("jsonl", "cloudevents"):
        text = (await _usage(http, b, **period, format=fmt, tenant=a.name)).text
        lines = [json.loads(line) for line in text.splitlines() if line]
        assert len(lines) == 1 and b.tenant_id in text and a.tenant_id not in text, text


async def test_idempotent_answers_are_never_replayed_or_revealed_across_tenants(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    a, b = await _tenant(stack, "idem-a"), await _tenant(stack, "idem-b")
    shared, probe = f"key-{uuid.uuid4()}", f"key-{uuid.uuid4()}"
    first_a = await _chat(http, a, "the same question", shared)
    first_b = await _chat(http, b, "the same question", shared)
    assert REPLAYED not in first_b.headers, "b got a's stored answer"
    assert first_b.json()["id"] != first_a.json()["id"]
    # Another body under a key a used is no 422 for b: it learns nothing of a's keys.
    await _chat(http, a, "a's body", probe)
    await _chat(http, b, "b's other body", probe)
    # Each tenant's retry replays its own answer, and each run is billed to its own tenant.
    again_b = await _chat(http, b, "the same question", shared)
    assert again_b.headers.get(REPLAYED) == "true"
    assert again_b.json()["id"] == first_b.json()["id"]
    assert (await _usage(http, a)).json()["total"]["requests"] == 2
    assert (await _usage(http, b)).json()["total"]["requests"] == 2


async def test_a_request_log_is_the_admins_to_read(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    a, b = await _tenant(stack, "log-a"), await _tenant(stack, "log-b")
    enabled = await stack.admin.patch(
        f"/admin/v1/tenants/{a.name}/billing", json={"request_log": True}
    )
    assert enabled.status_code == 200, enabled.text
    marker = f"marker-{uuid.uuid4().hex}"
    await _chat(http, a, f"remember {marker}")
    path = f"/admin/v1/tenants/{a.name}/request-log"
    period = {"from": "2000-01-01", "to": "2100-01-01"}
    logged = await stack.admin.get(path, params=period)
    assert marker in logged.text, "the admin reads it: the refusals below are not vacuous"
    for key_of in (a, b):  # neither the other tenant nor the tenant itself
        refused = await http.get(path, params=period, headers=key_of.headers)
        assert refused.status_code == 403 and marker not in refused.text
    for fmt in ("json", "jsonl"):
        usage = await _usage(http, b, format=fmt, **period)
        assert marker not in usage.text


def _admin_routes() -> list[tuple[str, str]]:
    """Every (method, path) under ``/admin``, from the app's own routing table."""
    app = create_app(GatewayConfig(upstream=UpstreamConfig()), Deployments([]))
    routes = [
        (method, route.path)
        for route in app.routes
        if isinstance(route, Route) and route.path.startswith("/admin/")
        for method in sorted(route.methods or ())
        if method != "HEAD"
    ]
    assert len(routes) >= 40, routes  # the table was read, not an empty app
    return routes


async def test_every_admin_route_refuses_a_tenant_key(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    tenant = await _tenant(stack, "not-an-admin")
    before = (await stack.admin.get("/admin/v1/tenants")).json()
    answers: dict[str, Any] = {}
    for method, template in _admin_routes():
        path = re.sub(r"\{[^}]+\}", tenant.name, template)
        body = {"name": "made-by-a-tenant"} if method in ("POST", "PUT", "PATCH") else None
        response = await http.request(method, path, json=body, headers=tenant.headers)
        error = response.json().get("error", {})
        answers[f"{method} {template}"] = (response.status_code, error.get("type"))
    refused = {
        route: answer for route, answer in answers.items() if answer != (403, "permission_denied")
    }
    assert not refused, f"admin routes that did not refuse a tenant key: {refused}"
    assert (await stack.admin.get("/admin/v1/tenants")).json() == before, "nothing changed"


async def test_a_credential_with_non_ascii_bytes_is_refused_not_an_error(
    http: httpx.AsyncClient,
) -> None:
    """Header bytes past ASCII reach the checks as text too (latin-1): both routes answer 401."""
    odd = {"Authorization": b"Bearer tdm-caf\xe9"}
    admin = await http.get("/admin/v1/tenants", headers=odd)
    assert (admin.status_code, admin.json()["error"]["code"]) == (401, "invalid_admin_key")
    serving = await http.get("/v1/models", headers=odd)
    assert (serving.status_code, serving.json()["error"]["code"]) == (401, "invalid_api_key")


async def test_metrics_with_every_tenants_usage_are_not_for_tenants(stack: FakeStack) -> None:
    """``/metrics`` carries each tenant's tokens, spend and budget: a client off the gateway's
    host reads it with the admin key only; a tenant key is refused as on the admin API."""
    tenant = await _tenant(stack, "metrics-reader")
    away = {"x-forwarded-for": "203.0.113.50"}  # a client on another host, via the proxy
    transport = httpx.AsyncHTTPTransport(local_address=PROXY)
    async with httpx.AsyncClient(base_url=stack.base_url, transport=transport) as proxied:
        await _chat(proxied, tenant, "count me")
        refused = {
            "no key": await proxied.get("/metrics", headers=away),
            "tenant key": await proxied.get("/metrics", headers={**away, **tenant.headers}),
        }
        admin = {**away, "Authorization": f"Bearer {ADMIN_KEY}"}
        allowed = await proxied.get("/metrics", headers=admin)
    assert {name: r.status_code for name, r in refused.items()} == {
        "no key": 401,
        "tenant key": 403,
    }
    assert all(tenant.name not in r.text for r in refused.values())
    assert refused["no key"].json()["error"]["code"] == "invalid_admin_key"
    assert "TANDEM_METRICS_PUBLIC" in refused["no key"].json()["error"]["message"]
    assert allowed.status_code == 200 and tenant.name in allowed.text
    # On the gateway's own host (the scrapers of tests/e2e and bench/), no key is needed.
    async with httpx.AsyncClient(base_url=stack.base_url) as local:
        assert tenant.name in (await local.get("/metrics")).text
