"""Two gateway replicas sharing one Redis: a traffic policy set on one is in force on the other.

The acceptance criterion: "a policy set on replica A is in force on replica B within 2 s". Every
process is real: the session's ``redis-server`` (a database of its own), two fake decode engines
and two ``tandem up`` gateways. The version registry, the policies and the audit log live in
Redis; deployments belong to each gateway process, so both versions are deployed on both
(version 1 on engine 1, version 2 on engine 2). Policies are set on A only; B learns them by
polling the store's policy revision (``gateway/catalog.py``, every 0.5 s).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.serving.flow import VERSION_HEADER
from tests.gateway.replica import (
    ENGINE_MODEL,
    Replicas,
    admin_client,
    create_tenant,
    seconds_until,
    two_gateways,
)

ALIAS = "tiny"
REDIS_DB = 11
"""This module's own database on the session's server: its policies and audit log start empty
and nothing another test leaves there can show up in them."""
PROPAGATION_S = 2.0
"""The acceptance bound: policy revision polled every 0.5 s, plus slack."""
NUM_FLIPS = 5
NUM_CONFIRMING = 5
"""Requests to B after each flip was seen there: every one names the new version (no flapping
back to the old one)."""


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[Replicas]:
    """Two fake decode engines and two gateway processes on one Redis database, torn down even
    on failure; the versions are deployed by the test."""
    with two_gateways(redis_url, REDIS_DB, "versions-replicas") as replicas:
        yield replicas


async def served_version(client: httpx.AsyncClient, key: str) -> str:
    """The version that served one request for ``ALIAS``; both places that name it agree."""
    response = await client.post(
        "/v1/completions",
        json={"model": ALIAS, "prompt": [1, 2, 3], "max_tokens": 8},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200, response.text
    named = response.json()["model"]
    assert response.headers[VERSION_HEADER] == named, response.headers
    return str(named)


async def put_policy(admin: httpx.AsyncClient, version: str, reason: str) -> None:
    """All of ``ALIAS``'s traffic to ``version``."""
    body = {"split": [{"version": version, "weight": 100}], "reason": reason}
    response = await admin.put(f"/admin/v1/traffic/{ALIAS}", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["split"] == [{"version": version, "weight": 100}], response.text


async def test_a_policy_set_on_one_replica_is_in_force_on_the_other_within_2_s(
    replicas: Replicas,
) -> None:
    """Versions registered on A are listed by B; a policy set on A is applied by A at once and
    by B within ``PROPAGATION_S``, flip after flip; both show the same audit log."""
    async with (
        admin_client(replicas.a) as admin_a,
        admin_client(replicas.b) as admin_b,
        httpx.AsyncClient(base_url=replicas.a.base_url, timeout=10.0) as on_a,
        httpx.AsyncClient(base_url=replicas.b.base_url, timeout=10.0) as on_b,
    ):
        _, key = await create_tenant(admin_a, "flipper")

        versions = []
        for i, folder in enumerate(replicas.folders, start=1):
            registered = await admin_a.post(
                "/admin/v1/models",
                json={"source": str(folder), "alias": ALIAS, "reason": f"register v{i} via A"},
            )
            assert registered.status_code == 201, registered.text
            versions.append(str(registered.json()["name"]))
        v1, v2 = versions
        assert v1 != v2 and all(v.startswith(f"{ALIAS}@") for v in versions), versions

        # The registry is shared: B lists what A registered (and has deployed neither yet).
        listed = (await admin_b.get("/admin/v1/models", params={"alias": ALIAS})).json()["data"]
        assert {(v["name"], v["deployed"]) for v in listed} == {(v1, False), (v2, False)}

        # Deployments are per process: each version on each gateway, on its own engine.
        for admin in (admin_a, admin_b):
            for version, engine in zip(versions, replicas.engines, strict=True):
                deployed = await admin.post(
                    "/admin/v1/deployments",
                    json={
                        "version": version,
                        "decode_workers": 0,
                        "decode_urls": [engine.base_url],
                        "served_as": ENGINE_MODEL,
                        "reason": f"deploy {version}",
                    },
                )
                assert deployed.status_code == 201, deployed.text
                assert deployed.json()["healthy"] is True, deployed.text

        await put_policy(admin_a, v1, "start on v1 via A")

        async def b_serves_v1() -> bool:
            return await served_version(on_b, key) == v1

        await seconds_until(b_serves_v1, PROPAGATION_S)

        took: list[float] = []
        current = v1
        for flip in range(1, NUM_FLIPS + 1):
            target = v2 if current == v1 else v1
            assert await served_version(on_b, key) == current  # B still on the old version
            started = time.monotonic()
            await put_policy(admin_a, target, f"flip {flip} to {target} via A")
            # A applies its own change before answering the PUT.
            assert await served_version(on_a, key) == target

            async def b_serves_target(target: str = target) -> bool:
                return await served_version(on_b, key) == target

            await seconds_until(b_serves_target, PROPAGATION_S)
            took.append(time.monotonic() - started)
            for _ in range(NUM_CONFIRMING):
                assert await served_version(on_b, key) == target
            current = target

        print(
            f"policy set on A in force on B after (s): {', '.join(f'{t:.3f}' for t in took)}; "
            f"max {max(took):.3f}"
        )
        assert max(took) < PROPAGATION_S, took

        # One audit log: B shows every change made through A, and A those made through B.
        log_a = (await admin_a.get("/admin/v1/audit", params={"alias": ALIAS})).json()["data"]
        log_b = (await admin_b.get("/admin/v1/audit", params={"alias": ALIAS})).json()["data"]
        assert log_a == log_b
        actions = [(entry["action"], entry["subject"]) for entry in log_b]
        assert actions[:2] == [("version.register", v1), ("version.register", v2)]
        assert actions.count(("deployment.create", v1)) == 2
        assert actions.count(("deployment.create", v2)) == 2
        reasons = [entry["reason"] for entry in log_b if entry["action"] == "policy.set"]
        expected = ["start on v1 via A"]
        current = v1
        for flip in range(1, NUM_FLIPS + 1):
            current = v2 if current == v1 else v1
            expected.append(f"flip {flip} to {current} via A")
        assert reasons == expected
        assert [entry["seq"] for entry in log_b] == sorted(entry["seq"] for entry in log_b)
