"""The key that sends prompts sharing a prefix to the same prefill worker.

vLLM's prefix cache skips recomputing blocks it has seen; it only helps if requests that share
a prefix (a system prompt, a few-shot preamble, a conversation's history) land on the same
worker. The key is the start of the prompt text, so two requests agree on it exactly when
their first ``num_chars`` characters agree.
"""

from __future__ import annotations

from typing import Any


def prefix_key(body: dict[str, Any], num_chars: int) -> str:
    """The first ``num_chars`` characters of the prompt, roles included for chat."""
    if "messages" in body:
        parts: list[str] = []
        size = 0
        for message in body["messages"]:
            text = f"{message.get('role')}:{_text(message.get('content'))}\n"
            parts.append(text)
            size += len(text)
            if size >= num_chars:
                break
        return "".join(parts)[:num_chars]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return ",".join(map(str, prompt))[:num_chars]
    if isinstance(prompt, list) and prompt:
        return str(prompt[0])[:num_chars]
    return str(prompt or "")[:num_chars]


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return ""
