"""RemoteProvider against a real aiohttp server on 127.0.0.1 speaking ``/v1/moderations``."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from core.errors import ModerationUnavailableError
from core.moderation import OPENAI_CATEGORIES, Category
from moderation.remote import RemoteProvider, RemoteProviderConfig
from tests.http_app import served


@dataclass
class FakeClassifier:
    """Flags ``violence`` in any text containing "kill"; ``mode`` makes it misbehave."""

    mode: str = "ok"
    requests: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at teardown so a ``slow`` handler does not hold the server's shutdown."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.mode == "slow":
            await self.released.wait()
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "garbage":
            return web.Response(text="<html>not json</html>")
        if self.mode == "short":
            return web.json_response({"id": "modr-1", "results": []})
        return web.json_response(
            {"id": "modr-1", "model": "m", "results": [_result(t) for t in body["input"]]}
        )


def _result(text: str) -> dict[str, Any]:
    violent = "kill" in text
    scores = {c.value: 0.01 for c in OPENAI_CATEGORIES}
    scores["violence"] = 0.93 if violent else 0.02
    scores["harassment"] = 0.6  # above a 0.5 threshold, but the server does not flag it
    scores["future/category"] = 0.99  # keys Tandem does not know are ignored
    flags = {c.value: False for c in OPENAI_CATEGORIES}
    flags["violence"] = violent
    flags["future/category"] = True
    return {"flagged": violent, "categories": flags, "category_scores": scores}


@pytest.fixture
async def classifier() -> AsyncIterator[tuple[FakeClassifier, str]]:
    fake = FakeClassifier()
    app = web.Application()
    app.router.add_post("/v1/moderations", fake.handle)
    async with served(app) as base_url:
        try:
            yield fake, base_url
        finally:
            fake.released.set()


@pytest.fixture
async def started() -> AsyncIterator[list[RemoteProvider]]:
    providers: list[RemoteProvider] = []
    yield providers
    for p in providers:
        await p.aclose()


async def make(started: list[RemoteProvider], url: str, **kw: Any) -> RemoteProvider:
    provider = RemoteProvider("openai", RemoteProviderConfig(url=url, **kw))
    await provider.start()
    started.append(provider)
    return provider


async def test_results_are_mapped_per_text(
    classifier: tuple[FakeClassifier, str], started: list[RemoteProvider]
) -> None:
    fake, url = classifier
    provider = await make(started, url, model="omni-moderation-latest", api_key="sk-test")
    results = await provider.check(["hello", "I will kill it"])
    assert fake.requests == [
        {"input": ["hello", "I will kill it"], "model": "omni-moderation-latest"}
    ]
    assert fake.auth == ["Bearer sk-test"]
    assert results[0].hits == ()
    (hit,) = results[1].hits
    assert (hit.category, hit.provider, hit.start, hit.end, hit.score) == (
        Category.VIOLENCE,
        "openai",
        None,
        None,
        0.93,
    )
    assert results[1].scores[Category.VIOLENCE] == 0.93
    assert results[1].scores[Category.PII] == 0.0
    assert set(results[1].scores) == set(Category)
    assert results[1].checked == frozenset(OPENAI_CATEGORIES)
    assert provider.failures == 0


async def test_threshold_uses_scores_not_flags(
    classifier: tuple[FakeClassifier, str], started: list[RemoteProvider]
) -> None:
    _, url = classifier
    provider = await make(started, url, threshold=0.5)
    (result,) = await provider.check(["hello"])
    assert {h.category for h in result.hits} == {Category.HARASSMENT}


async def test_no_texts_sends_no_request(
    classifier: tuple[FakeClassifier, str], started: list[RemoteProvider]
) -> None:
    fake, url = classifier
    provider = await make(started, url)
    assert await provider.check([]) == []
    assert fake.requests == []


@pytest.mark.parametrize("mode", ["slow", "500", "garbage", "short"])
async def test_failure_open_lets_text_through(
    mode: str,
    classifier: tuple[FakeClassifier, str],
    started: list[RemoteProvider],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake, url = classifier
    fake.mode = mode
    provider = await make(started, url, timeout_s=0.3, on_failure="open")
    with caplog.at_level(logging.WARNING, logger="moderation.remote"):
        results = await provider.check(["I will kill it", "hi"])
    assert [r.hits for r in results] == [(), ()]
    assert all(r.checked == frozenset() for r in results)
    assert provider.failures == 1
    assert "failing open" in caplog.text and "'openai'" in caplog.text


@pytest.mark.parametrize(
    ("mode", "reason"), [("slow", "timed out"), ("500", "HTTP 500"), ("garbage", "not JSON")]
)
async def test_failure_closed_raises_moderation_unavailable(
    mode: str, reason: str, classifier: tuple[FakeClassifier, str], started: list[RemoteProvider]
) -> None:
    fake, url = classifier
    fake.mode = mode
    provider = await make(started, url, timeout_s=0.3, on_failure="closed")
    with pytest.raises(ModerationUnavailableError) as caught:
        await provider.check(["hi"])
    assert caught.value.status_code == 503
    assert "'openai'" in caught.value.message and reason in caught.value.message
    assert "on_failure" in caught.value.message
    assert provider.failures == 1


async def test_connection_refused_fails_open(started: list[RemoteProvider]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    provider = await make(started, f"http://127.0.0.1:{port}", on_failure="open")
    assert [r.hits for r in await provider.check(["x"])] == [()]
    assert provider.failures == 1


async def test_check_before_start_is_a_programming_error() -> None:
    provider = RemoteProvider("openai", RemoteProviderConfig(url="http://127.0.0.1:1"))
    with pytest.raises(RuntimeError, match="before start"):
        await provider.check(["x"])
    await provider.aclose()  # harmless without start


@pytest.mark.parametrize(
    ("kw", "field_name"),
    [
        ({"url": "127.0.0.1:8000"}, "url"),
        ({"url": "http://x", "timeout_s": 0}, "timeout_s"),
        ({"url": "http://x", "on_failure": "maybe"}, "on_failure"),
        ({"url": "http://x", "threshold": 1.5}, "threshold"),
    ],
)
def test_config_errors_name_the_field(kw: dict[str, Any], field_name: str) -> None:
    with pytest.raises(ValueError, match=f"^{field_name} "):
        RemoteProviderConfig(**kw)


def test_endpoint_joins_the_base_url() -> None:
    assert RemoteProviderConfig(url="http://h:8000/").endpoint == "http://h:8000/v1/moderations"
