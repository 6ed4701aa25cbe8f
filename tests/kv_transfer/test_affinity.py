"""The prefix-affinity key, read from a parsed prompt."""

from __future__ import annotations

from typing import Any

from core.messages import Endpoint
from core.prompt import Prompt
from kv_transfer.affinity import prefix_key


def chat(*messages: dict[str, Any]) -> Prompt:
    return Prompt.parse(Endpoint.CHAT, {"model": "m", "messages": list(messages)})


def completion(prompt: Any) -> Prompt:
    return Prompt.parse(Endpoint.COMPLETIONS, {"model": "m", "prompt": prompt})


def test_prefix_key() -> None:
    prompt = chat({"role": "system", "content": "abc"}, {"role": "user", "content": "x"})
    assert prefix_key(prompt, 100) == "system:abc\nuser:x\n"
    assert prefix_key(prompt, 6) == "system"
    assert prefix_key(completion("hello world"), 5) == "hello"
    assert prefix_key(completion([1, 2, 3]), 3) == "1,2"
    assert prefix_key(completion(["first", "second"]), 10) == "first"


def test_chat_key_joins_text_parts_and_keeps_textless_messages() -> None:
    prompt = chat(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
    )
    assert prefix_key(prompt, 100) == "user:a\nassistant:\nuser:bc\n"


def test_key_is_the_prefix_of_the_whole_prompt() -> None:
    long = chat({"role": "system", "content": "s" * 1000}, {"role": "user", "content": "u"})
    assert prefix_key(long, 256) == ("system:" + "s" * 1000)[:256]
    assert prefix_key(completion(list(range(1000))), 20) == ",".join(map(str, range(1000)))[:20]
    assert prefix_key(completion([[1, 2, 3], [4]]), 5) == "[1, 2"
