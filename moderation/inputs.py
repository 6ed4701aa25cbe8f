"""The texts input moderation reads from a request body, and the body with them replaced.

Both functions walk the body the same way (:func:`_walk`), so the n-th text
:func:`texts_of` returns is the n-th text :func:`with_texts` replaces. Shapes it does not
know (token-id prompts, image parts, a malformed message) carry no text and are left alone:
the body's own validation is the gateway's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from core.messages import Endpoint

_Replace = Callable[[str], str]


def texts_of(endpoint: Endpoint, body: dict[str, Any]) -> list[str]:
    """Every text to moderate in ``body``, in order: chat message contents (strings or
    ``text`` parts), or a completions ``prompt`` (a string or a list of strings)."""
    found: list[str] = []

    def collect(text: str) -> str:
        found.append(text)
        return text

    _walk(endpoint, body, collect)
    return found


def with_texts(endpoint: Endpoint, body: dict[str, Any], texts: Sequence[str]) -> dict[str, Any]:
    """A copy of ``body`` with its texts (as :func:`texts_of` lists them) replaced by
    ``texts``, in the same order; ``body`` itself is not changed."""
    count = len(texts_of(endpoint, body))
    if count != len(texts):
        raise ValueError(f"with_texts got {len(texts)} texts; the body has {count}")
    supply = iter(texts)
    return _walk(endpoint, body, lambda _old: next(supply))


def _walk(endpoint: Endpoint, body: dict[str, Any], visit: _Replace) -> dict[str, Any]:
    """Call ``visit`` on each text in order; return a copy of ``body`` holding its results
    (copying only the containers on the way to a text)."""
    copy = dict(body)
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if isinstance(messages, list):
            copy["messages"] = [_walk_message(m, visit) for m in messages]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            copy["prompt"] = visit(prompt)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            copy["prompt"] = [visit(p) for p in prompt]
        # A list of token ids (or of lists of them) has no text to read.
    return copy


def _walk_message(message: Any, visit: _Replace) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": visit(content)}
    if isinstance(content, list):
        return {**message, "content": [_walk_part(part, visit) for part in content]}
    return message


def _walk_part(part: Any, visit: _Replace) -> Any:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return {**part, "text": visit(part["text"])}
    return part
