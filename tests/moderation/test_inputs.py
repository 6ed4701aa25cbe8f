"""Texts read from chat and completions bodies, and written back in the same order."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from core.messages import Endpoint
from core.prompt import Prompt
from moderation.inputs import with_texts

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be nice"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://x/i.png"}},
                {"type": "text", "text": "at this"},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": []},
    ],
}


def texts_of(endpoint: Endpoint, body: dict[str, Any]) -> list[str]:
    """What moderation reads: the prompt's texts."""
    return list(Prompt.parse(endpoint, body).texts)


def test_chat_texts_in_order() -> None:
    assert texts_of(Endpoint.CHAT, CHAT) == ["be nice", "look", "at this"]


def test_chat_with_texts_replaces_in_order_without_touching_the_original() -> None:
    before = copy.deepcopy(CHAT)
    out = with_texts(Endpoint.CHAT, CHAT, ["A", "B", "C"])
    assert before == CHAT
    assert texts_of(Endpoint.CHAT, out) == ["A", "B", "C"]
    assert out["messages"][1]["content"][1] == CHAT["messages"][1]["content"][1]
    assert out["messages"][2] == CHAT["messages"][2]
    assert out["model"] == "m"


@pytest.mark.parametrize(
    ("prompt", "texts"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], []), ([[1, 2], [3]], [])],
)
def test_completions_prompts(prompt: Any, texts: list[str]) -> None:
    body = {"model": "m", "prompt": prompt}
    assert texts_of(Endpoint.COMPLETIONS, body) == texts
    replaced = with_texts(Endpoint.COMPLETIONS, body, [t.upper() for t in texts])
    assert texts_of(Endpoint.COMPLETIONS, replaced) == [t.upper() for t in texts]
    assert body["prompt"] == prompt


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (Endpoint.CHAT, CHAT),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": ["one", "two", "three"]}),
        (Endpoint.COMPLETIONS, {"model": "m", "prompt": "only"}),
    ],
)
def test_with_texts_replaces_exactly_the_prompt_texts_in_order(
    endpoint: Endpoint, body: dict[str, Any]
) -> None:
    texts = Prompt.parse(endpoint, body).texts
    marked = [f"<{i}:{text}>" for i, text in enumerate(texts)]
    out = with_texts(endpoint, body, marked)
    assert Prompt.parse(endpoint, out).texts == tuple(marked)
    # Only the texts changed: put them back and the original body is what remains.
    assert with_texts(endpoint, out, list(texts)) == body


def test_wrong_number_of_texts_is_refused() -> None:
    with pytest.raises(ValueError, match="got 2 texts; the body has 3"):
        with_texts(Endpoint.CHAT, CHAT, ["a", "b"])
    with pytest.raises(ValueError, match="got 1 texts; the body has 2"):
        with_texts(Endpoint.COMPLETIONS, {"prompt": ["a", "b"]}, ["a"])
    with pytest.raises(ValueError, match="got 2 texts; the body has 1"):
        with_texts(Endpoint.COMPLETIONS, {"prompt": "a"}, ["a", "b"])
