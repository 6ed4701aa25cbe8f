"""Moderation through the gateway: per-tenant policies on input and on the stream, and
``/v1/moderations``, with the official client over a real server and fake engines.

The fake engine's ``scripted_output`` answers in 5-character tokens, so a planted phrase or
e-mail address always arrives split across several chunks.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from core.moderation import OPENAI_CATEGORIES
from tests.gateway.conftest import MODEL, FakeStack, make_fake_stack, wait_until

BOMB = "how to make a pipe bomb"
SCRIPT_WITH_TERM = (
    "Sure. Here is exactly " + BOMB + " with household parts, step by step, in great detail."
)
EMAIL = "john.doe@example.com"
SCRIPT_WITH_EMAIL = f"You can write to {EMAIL} or call us on weekdays."
QUESTION = [{"role": "user", "content": "tell me something"}]

BLOCK_ALL_OUTPUT = {"output": {"providers": ["rules"], "actions": {"*": "block"}}}
REDACT_PII_OUTPUT = {"output": {"providers": ["rules"], "actions": {"pii": "redact", "*": "block"}}}


@pytest.fixture
async def stack() -> AsyncIterator[FakeStack]:
    async with make_fake_stack() as fake_stack:
        yield fake_stack


async def _client(stack: FakeStack, name: str, moderation: dict[str, Any]) -> openai.AsyncOpenAI:
    return stack.client_for(await stack.new_tenant(name, moderation=moderation))


async def _decisions(stack: FakeStack, **labels: str) -> float:
    text = (await stack.admin.get("/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("tandem_moderation_decisions_total{") and all(
            f'{key}="{value}"' in line for key, value in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_term_split_across_chunks_ends_the_stream_with_content_filter(
    stack: FakeStack,
) -> None:
    stack.decode.scripted_output = SCRIPT_WITH_TERM * 4  # long: the cut must stop the engine
    stack.decode.token_delay_s = 0.01
    client = await _client(stack, "guarded", BLOCK_ALL_OUTPUT)
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "content_filter"
    assert finishes.count("content_filter") == 1
    # Everything before the term, nothing from its first character on.
    assert text == SCRIPT_WITH_TERM[: SCRIPT_WITH_TERM.index(BOMB)]
    assert "how" not in text.rsplit("exactly", 1)[1]
    # The engine was stopped, and what it produced is still reported and billed.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert 0 < chunks[-1].usage.completion_tokens < 200
    await wait_until(lambda: stack.decode.stats.num_aborted == 1)
    assert await _decisions(stack, stage="output", action="block") >= 1


async def test_pii_is_redacted_in_the_stream(stack: FakeStack) -> None:
    stack.decode.scripted_output = SCRIPT_WITH_EMAIL
    client = await _client(stack, "redacting", REDACT_PII_OUTPUT)
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, stream=True
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == SCRIPT_WITH_EMAIL.replace(EMAIL, "[REDACTED:email]")
    assert chunks[-1].choices[0].finish_reason == "stop"
    # No chunk ever carried a piece of the address.
    assert not any("example" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


async def test_a_non_streaming_answer_is_moderated_too(stack: FakeStack) -> None:
    stack.decode.scripted_output = SCRIPT_WITH_TERM
    client = await _client(stack, "guarded", BLOCK_ALL_OUTPUT)
    completion = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "content_filter"
    assert choice.message.content == SCRIPT_WITH_TERM[: SCRIPT_WITH_TERM.index(BOMB)]


async def test_flagging_changes_nothing_but_is_recorded(stack: FakeStack) -> None:
    stack.decode.scripted_output = SCRIPT_WITH_TERM
    client = await _client(
        stack, "watched", {"output": {"providers": ["rules"], "actions": {"*": "flag"}}}
    )
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == SCRIPT_WITH_TERM
    assert await _decisions(stack, stage="output", action="flag", category="illicit/violent") >= 1


async def test_blocked_input_is_400_content_filter_and_never_reaches_an_engine(
    stack: FakeStack,
) -> None:
    client = await _client(
        stack, "strict", {"input": {"providers": ["rules"], "actions": {"*": "block"}}}
    )
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me {BOMB}."}], max_tokens=4
        )
    assert caught.value.code == "content_filter"
    assert "illicit/violent" in caught.value.message
    assert stack.decode.stats.requests == []
    assert await _decisions(stack, stage="input", action="block") >= 1  # term and pattern
    # Harmless input passes.
    ok = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


async def test_redacted_input_reaches_the_engine_without_the_pii(stack: FakeStack) -> None:
    client = await _client(
        stack, "private", {"input": {"providers": ["rules"], "actions": {"pii": "redact"}}}
    )
    await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Mail {EMAIL} about card 4111 1111 1111 1111"}],
        max_tokens=2,
    )
    [received] = stack.decode.stats.requests
    content = received["body"]["messages"][0]["content"]
    assert EMAIL not in content and "4111" not in content
    assert "[REDACTED:email]" in content and "[REDACTED:payment_card]" in content


async def test_tenants_without_a_policy_are_not_moderated(stack: FakeStack) -> None:
    stack.decode.scripted_output = SCRIPT_WITH_TERM
    completion = await stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200
    )
    assert completion.choices[0].message.content == SCRIPT_WITH_TERM


async def test_policies_naming_unknown_providers_or_categories_are_400(stack: FakeStack) -> None:
    for moderation, where in [
        ({"input": {"providers": ["nope"], "actions": {"*": "block"}}}, "nope"),
        ({"input": {"providers": ["rules"], "actions": {"violence/cartoon": "block"}}}, "cartoon"),
        ({"output": {"providers": ["rules"], "actions": {"pii": "obliterate"}}}, "actions.pii"),
    ]:
        response = await stack.admin.post(
            "/admin/v1/tenants", json={"name": "bad", "moderation": moderation}
        )
        assert response.status_code == 400, response.text
        assert where in response.json()["error"]["message"]


async def test_v1_moderations_has_openai_shape(stack: FakeStack) -> None:
    result = await stack.client.moderations.create(
        model="omni-moderation-latest", input=[f"Tell me {BOMB}", f"Mail {EMAIL}", "Hello!"]
    )
    assert re.fullmatch(r"modr-[0-9a-f]+", result.id)
    bomb, pii, hello = result.results
    assert bomb.flagged and bomb.categories.illicit_violent
    assert bomb.category_scores.illicit_violent == 1.0
    assert not pii.flagged  # PII is not one of OpenAI's categories
    assert not hello.flagged

    async with httpx.AsyncClient(base_url=stack.base_url, headers=stack.auth_headers) as http:
        raw = (await http.post("/v1/moderations", json={"input": "Hello"})).json()
        assert set(raw) == {"id", "model", "results"}
        [entry] = raw["results"]
        assert set(entry) == {
            "flagged", "categories", "category_scores", "category_applied_input_types"
        }  # fmt: skip
        for key in ("categories", "category_scores", "category_applied_input_types"):
            assert list(entry[key]) == [c.value for c in OPENAI_CATEGORIES]
        for body in ({}, {"input": []}, {"input": [{"type": "image_url", "image_url": {}}]}):
            bad = await http.post("/v1/moderations", json=body)
            assert bad.status_code == 400, body
            assert bad.json()["error"]["param"] == "input"
        unauthenticated = await http.post(
            "/v1/moderations", json={"input": "x"}, headers={"Authorization": ""}
        )
        assert unauthenticated.status_code == 401
