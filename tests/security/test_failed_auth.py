"""Repeated failed authentications from one client are slowed (429) through the real gateway,
without a key lookup, while other clients keep working (docs/WIRE.md §2).

Clients are told apart by their real source address: every test client binds its own loopback
address (``127.0.0.2``, ``127.0.0.3``, ...). Key lookups are watched on a real Redis with
``MONITOR``: the registry's lookup script reads ``<prefix>key_hash:<sha256>``, so a guessed
key's hash in the command stream is that key looked up.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from gateway.auth_throttle import AuthThrottleConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from tests.redis_server import Lookups, RedisServer, running_redis

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LIMIT = 3
PROXY = "127.0.0.9"  # the one peer whose X-Forwarded-For is believed


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server


@pytest.fixture(scope="module")
async def stack(redis_server: RedisServer) -> AsyncIterator[FakeStack]:
    """One gateway for the module; each test uses client addresses of its own, so the
    throttle's state of one test is not another's."""
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(redis_url=redis_server.url),
        auth_throttle=AuthThrottleConfig(
            max_failures=LIMIT, window_s=30.0, trusted_proxies=(PROXY,)
        ),
    )
    async with make_fake_stack(access=access) as fake_stack:
        yield fake_stack


@asynccontextmanager
async def client_at(stack: FakeStack, address: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client whose connections come from ``address``."""
    transport = httpx.AsyncHTTPTransport(local_address=address)
    async with httpx.AsyncClient(base_url=stack.base_url, transport=transport) as client:
        yield client


async def chat(client: httpx.AsyncClient, key: str | None, **headers: str) -> httpx.Response:
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return await client.post("/v1/chat/completions", json=CHAT, headers=headers)


def guess() -> str:
    return f"tdm-guessed-{uuid.uuid4().hex}"


def throttled_error(response: httpx.Response) -> dict[str, Any]:
    """The 429's error object, checked for OpenAI's shape and the retry hints."""
    assert response.status_code == 429, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "requests",
        "too_many_auth_failures",
        None,
    )
    assert int(response.headers["retry-after"]) >= 1
    assert int(response.headers["retry-after-ms"]) >= 1
    assert "x-should-retry" not in response.headers  # a valid key gets through after the wait
    return error


async def test_a_guesser_is_slowed_without_lookups_while_others_keep_working(
    stack: FakeStack, redis_server: RedisServer
) -> None:
    known = await stack.new_tenant("known")  # used by the guesser's neighbour before
    fresh = await stack.new_tenant("fresh")  # never used before the throttle
    guesses = [guess() for _ in range(LIMIT + 3)]
    async with (
        Lookups(redis_server.url).watching() as lookups,
        client_at(stack, "127.0.0.2") as guesser,
        client_at(stack, "127.0.0.3") as other,
    ):
        assert (await chat(guesser, known)).status_code == 200
        for wrong in guesses[:LIMIT]:
            response = await chat(guesser, wrong)
            assert response.status_code == 401 and response.json()["error"]["code"] == (
                "invalid_api_key"
            )
        for wrong in guesses[LIMIT:]:
            message = throttled_error(await chat(guesser, wrong))["message"]
            assert f"{LIMIT} within 30 s" in message, message
        throttled_error(await chat(guesser, None))  # no key at all: throttled as well
        # /v1/usage and the admin API authenticate through the same throttle.
        throttled_error(await guesser.get("/v1/usage", headers={"Authorization": "Bearer x"}))
        wrong_admin = {"Authorization": f"Bearer {ADMIN_KEY}-guess"}
        throttled_error(await guesser.get("/admin/v1/tenants", headers=wrong_admin))

        # A key this gateway verified passes from the throttled address; one it has not
        # verified waits, until another client's request verified it.
        assert (await chat(guesser, known)).status_code == 200
        throttled_error(await chat(guesser, fresh))
        assert (await chat(other, fresh)).status_code == 200
        assert (await chat(guesser, fresh)).status_code == 200
        # The admin key is never throttled (checking it looks nothing up); a verified tenant
        # key on the admin API is still refused as one.
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        assert (await guesser.get("/admin/v1/tenants", headers=admin)).status_code == 200
        tenant_on_admin = {"Authorization": f"Bearer {known}"}
        assert (await guesser.get("/admin/v1/tenants", headers=tenant_on_admin)).status_code == 403

        # The other client's failures are its own: 401, not 429.
        other_guess = guess()
        assert (await chat(other, other_guess)).status_code == 401

    assert [lookups.of(wrong) > 0 for wrong in guesses] == [True] * LIMIT + [False] * 3
    assert lookups.of(other_guess) > 0


async def test_the_wait_ends_after_retry_after(tmp_path: Path) -> None:
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        auth_throttle=AuthThrottleConfig(max_failures=2, window_s=2.0),  # one attempt a second
    )
    async with make_fake_stack(access=access) as fresh_stack, client_at(
        fresh_stack, "127.0.0.4"
    ) as guesser:  # fmt: skip
        for _ in range(2):
            assert (await chat(guesser, guess())).status_code == 401
        refused = await chat(guesser, guess())
        throttled_error(refused)
        wait_ms = int(refused.headers["retry-after-ms"])
        assert 0 < wait_ms <= 1000
        await asyncio.sleep(wait_ms / 1000 + 0.05)
        assert (await chat(guesser, guess())).status_code == 401, "one refill: one attempt"
        throttled_error(await chat(guesser, guess()))


async def test_forwarded_for_names_the_client_only_behind_a_trusted_proxy(
    stack: FakeStack,
) -> None:
    async with client_at(stack, PROXY) as proxy, client_at(stack, "127.0.0.5") as direct:
        for _ in range(LIMIT):
            assert (
                await chat(proxy, guess(), **{"x-forwarded-for": "203.0.113.7"})
            ).status_code == 401
        throttled_error(await chat(proxy, guess(), **{"x-forwarded-for": "203.0.113.7"}))
        # Another client behind the same proxy, and the proxy itself, are not throttled.
        assert (await chat(proxy, guess(), **{"x-forwarded-for": "203.0.113.8"})).status_code == 401
        assert (await chat(proxy, guess())).status_code == 401
        # A client that is not a trusted proxy cannot pick its address with the header: each
        # request claims another client, and all count against the peer.
        for i in range(LIMIT):
            forged = {"x-forwarded-for": f"198.51.100.{i}"}
            assert (await chat(direct, guess(), **forged)).status_code == 401
        throttled_error(await chat(direct, guess(), **{"x-forwarded-for": "198.51.100.99"}))


async def test_concurrent_guesses_cannot_outrun_the_limit(
    stack: FakeStack, redis_server: RedisServer
) -> None:
    """Each lookup an attempt starts reserves a failure first: of a burst of guesses sent at
    once, the limit's worth are looked up, none more. A burst of one new valid key shares one
    lookup and reserves once, so it is never throttled."""
    guesses = [guess() for _ in range(30)]
    fresh = await stack.new_tenant("burst")
    async with (
        Lookups(redis_server.url).watching() as lookups,
        client_at(stack, "127.0.0.6") as guesser,
        client_at(stack, "127.0.0.7") as bursty,
    ):
        answers = await asyncio.gather(*(chat(guesser, wrong) for wrong in guesses))
        burst = await asyncio.gather(*(chat(bursty, fresh) for _ in range(20)))
    statuses = sorted(response.status_code for response in answers)
    assert statuses == [401] * LIMIT + [429] * (len(guesses) - LIMIT), statuses
    assert sum(lookups.of(wrong) > 0 for wrong in guesses) == LIMIT
    assert [response.status_code for response in burst] == [200] * 20
