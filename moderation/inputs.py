"""A request body with the texts input moderation read replaced (redacted ones, say).

Moderation reads a request's texts as ``core.prompt.Prompt.texts``; :func:`with_texts` writes
through the same walker (``core.prompt.walk_texts``), so the n-th text it replaces is the n-th
text of ``Prompt.texts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.messages import Endpoint
from core.prompt import walk_texts


def with_texts(endpoint: Endpoint, body: dict[str, Any], texts: Sequence[str]) -> dict[str, Any]:
    """``body`` with its texts (``Prompt.parse(endpoint, body).texts``) replaced by ``texts``
    in the same order. ``body`` itself is not changed: containers on the way to a changed text
    are copied, the rest is shared (``body`` itself comes back when no text changed)."""
    supply = iter(texts)
    count = 0

    def replace(old: str, _at: int) -> str:
        nonlocal count
        count += 1
        # Past the end of the supply keep walking, to name the body's count in the error.
        return next(supply, old)

    out = walk_texts(endpoint, body, replace)
    if count != len(texts):
        raise ValueError(f"with_texts got {len(texts)} texts; the body has {count}")
    return out
