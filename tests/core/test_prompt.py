"""A request's prompt read once from its body: texts, token ids, messages."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from core.messages import Endpoint
from core.prompt import Prompt, TokenEstimate, walk_texts

CHAT: dict[str, Any] = {
    "model": "m",
    "messages": [
        {"role": "system", "content": "be nice"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://x/i.png"}},
                {"type": "input_audio", "text": "not prompt text"},
                {"type": "text", "text": "at this"},
            ],
        },
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "user", "content": "well?"},
    ],
}


def test_chat_prompt() -> None:
    prompt = Prompt.parse(Endpoint.CHAT, CHAT)
    assert prompt.param == "messages"
    assert prompt.raw is CHAT["messages"]  # as sent, not a copy
    assert prompt.texts == ("be nice", "look", "at this", "well?")
    assert prompt.num_messages == 4
    assert prompt.led_by_system and prompt.without_texts().led_by_system
    assert prompt.num_literal_tokens == 0
    assert list(prompt.messages()) == [
        ("system", "be nice"),
        ("user", "lookat this"),
        ("assistant", ""),
        ("user", "well?"),
    ]


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user", "content": "hi"}], [{"role": "developer", "content": "x"}], [], ["x"]],
)
def test_only_a_system_message_first_leads_a_conversation(messages: list[Any]) -> None:
    assert not Prompt.parse(Endpoint.CHAT, {"model": "m", "messages": messages}).led_by_system


@pytest.mark.parametrize(
    ("raw", "texts", "num_literal_tokens"),
    [
        ("hi", ("hi",), 0),
        (["a", "b", "c"], ("a", "b", "c"), 0),
        ([1, 2, 3], (), 3),
        ([[1, 2], [3], [4, 5, 6]], (), 6),
    ],
)
def test_completions_prompt(raw: Any, texts: tuple[str, ...], num_literal_tokens: int) -> None:
    prompt = Prompt.parse(Endpoint.COMPLETIONS, {"model": "m", "prompt": raw})
    assert prompt.param == "prompt"
    assert prompt.raw is raw
    assert prompt.texts == texts
    assert prompt.num_literal_tokens == num_literal_tokens
    assert prompt.num_messages == 0
    assert list(prompt.messages()) == []


def test_parsing_leaves_the_body_alone() -> None:
    before = copy.deepcopy(CHAT)
    Prompt.parse(Endpoint.CHAT, CHAT)
    assert before == CHAT


def test_walk_returns_the_body_itself_when_no_text_changes() -> None:
    assert walk_texts(Endpoint.CHAT, CHAT, lambda text, _at: text) is CHAT
    body = {"prompt": ["a", "b"]}
    assert walk_texts(Endpoint.COMPLETIONS, body, lambda text, _at: text) is body


def test_walk_visits_each_text_with_the_index_holding_it() -> None:
    seen: list[tuple[str, int]] = []

    def visit(text: str, at: int) -> str:
        seen.append((text, at))
        return text

    walk_texts(Endpoint.CHAT, CHAT, visit)
    assert seen == [("be nice", 0), ("look", 1), ("at this", 1), ("well?", 3)]


def test_walk_copies_only_the_way_to_a_changed_text() -> None:
    out = walk_texts(
        Endpoint.CHAT, CHAT, lambda text, _at: text.upper() if text == "look" else text
    )
    assert out is not CHAT
    assert out["messages"][1]["content"][0] == {"type": "text", "text": "LOOK"}
    assert out["messages"][1]["content"][1] is CHAT["messages"][1]["content"][1]
    assert out["messages"][0] is CHAT["messages"][0]
    assert CHAT["messages"][1]["content"][0]["text"] == "look"


def test_token_estimate_total() -> None:
    assert TokenEstimate(prompt_tokens=10, max_output_tokens=5, num_choices=3).total_tokens == 25
