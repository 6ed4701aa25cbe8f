"""Two gateway replicas on one Redis run one rollout: exactly one evaluates it (the lease
holder), and when that one dies the other takes over within 10 s, from the state in Redis.

Every process is real: the session's ``redis-server`` (a database of its own), two fake decode
engines (one per version) and two ``tandem up`` gateways with a 2 s rollout lease. The holder
is killed with SIGKILL (no release): the survivor acquires the expired lease with a newer
fencing token, and an operator command sent to it is applied.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import Iterator

import pytest
import redis

from tests.gateway.replica import (
    ENGINE_MODEL,
    Process,
    Replicas,
    admin_client,
    two_gateways,
)

pytestmark = pytest.mark.asyncio

ALIAS = "tiny"
REDIS_DB = 12
LEASE_TTL_S = 2.0
TAKEOVER_S = 10.0
"""The acceptance bound."""


@pytest.fixture(scope="module")
def replicas(redis_url: str) -> Iterator[Replicas]:
    env = {"TANDEM_ROLLOUT_LEASE_TTL_S": str(LEASE_TTL_S), "TANDEM_ROLLOUT_TICK_S": "0.1"}
    with two_gateways(redis_url, REDIS_DB, "rollout-replicas", env) as replicas:
        yield replicas


def lease_holder(replicas: Replicas) -> Process:
    """The gateway whose controller holds the lease (its id is in Redis and in its log)."""
    with redis.Redis.from_url(replicas.redis_url, decode_responses=True) as raw:
        holder = raw.get("tandem:lease:rollouts")
    assert holder, "nobody holds the rollout lease"
    [process] = [
        g
        for g in replicas.gateways
        if re.search(rf"{holder} evaluates them", g.log_path.read_text())
    ]
    return process


async def test_the_survivor_takes_the_rollout_over_within_10_s(replicas: Replicas) -> None:
    a, b = replicas.gateways
    async with admin_client(a) as admin_a, admin_client(b) as admin_b:
        versions = []
        for folder in replicas.folders:
            registered = await admin_a.post(
                "/admin/v1/models", json={"source": str(folder), "alias": ALIAS}
            )
            assert registered.status_code == 201, registered.text
            versions.append(str(registered.json()["name"]))
        for admin in (admin_a, admin_b):
            for version, engine in zip(versions, replicas.engines, strict=True):
                deployed = await admin.post(
                    "/admin/v1/deployments",
                    json={"version": version, "decode_workers": 0,
                          "decode_urls": [engine.base_url], "served_as": ENGINE_MODEL},
                )  # fmt: skip
                assert deployed.status_code == 201, deployed.text
        started = await admin_a.post(
            "/admin/v1/rollouts",
            json={
                "alias": ALIAS,
                "baseline": versions[0],
                "candidate": versions[1],
                "steps": [{"weight": 20, "bake_s": 600}],
                "quality": {"enabled": False},
                "interval_s": 1,
            },
        )
        assert started.status_code == 201, started.text
        rollout_id = started.json()["id"]

        # One of them evaluates it: the 20 % step is put, seen from both.
        async def at_step() -> bool:
            shown = (await admin_b.get(f"/admin/v1/rollouts/{rollout_id}")).json()
            return bool(shown["phase"] == "canary" and shown["policy_applied"])

        deadline = time.monotonic() + 10
        while not await at_step():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)

        holder = lease_holder(replicas)
        survivor = b if holder is a else a
        killed_at = time.monotonic()
        holder.popen.send_signal(signal.SIGKILL)
        holder.popen.wait()

        async with admin_client(survivor) as admin:
            # The command is queued in Redis at once; only a lease holder applies it.
            paused = await admin.post(
                f"/admin/v1/rollouts/{rollout_id}/pause", json={"reason": "takeover check"}
            )
            assert paused.status_code in (200, 202), paused.text
            while True:
                shown = (await admin.get(f"/admin/v1/rollouts/{rollout_id}")).json()
                if shown["status"] == "paused":
                    break
                assert time.monotonic() - killed_at < TAKEOVER_S, shown["status"]
                await asyncio.sleep(0.1)
            took = time.monotonic() - killed_at
            print(f"the survivor applied a command {took:.2f} s after the holder died")
            assert lease_holder(replicas) is survivor
            # Its state survived: the step and the decisions so far, then the pause.
            events = [d["event"] for d in shown["decisions"]]
            assert events == ["started", "paused"]
            assert shown["weight"] == 20.0
            aborted = await admin.post(f"/admin/v1/rollouts/{rollout_id}/abort")
            assert aborted.json()["status"] == "aborted"
