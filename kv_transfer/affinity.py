"""The key that sends prompts sharing a prefix to the same prefill worker.

vLLM's prefix cache skips recomputing blocks it has seen; it only helps if requests that share
a prefix (a system prompt, a few-shot preamble, a conversation's history) land on the same
worker. The key is the start of the prompt text, so two requests agree on it exactly when
their first ``num_chars`` characters agree.
"""

from __future__ import annotations

from core.messages import Endpoint
from core.prompt import Prompt


def prefix_key(prompt: Prompt, num_chars: int) -> str:
    """The first ``num_chars`` characters of the prompt: ``role:text`` lines for chat, the
    string (or first string) for completions, token ids as ``1,2,3`` (or the first list's
    ``[1, 2, 3]``). Only split requests need it, so it reads no more of the prompt than that."""
    if prompt.endpoint is Endpoint.CHAT:
        parts: list[str] = []
        size = 0
        for role, text in prompt.messages():
            # What lies past num_chars is cut off below anyway: do not copy it.
            line = f"{role}:{text[: num_chars - size]}\n"
            parts.append(line)
            size += len(line)
            if size >= num_chars:
                break
        return "".join(parts)[:num_chars]
    raw = prompt.raw
    if isinstance(raw, list) and raw and isinstance(raw[0], int):
        # Each id takes at least one character: no more ids than characters are needed.
        return ",".join(map(str, raw[:num_chars]))[:num_chars]
    if isinstance(raw, list) and raw:
        first = raw[0]
        return str(first[:num_chars] if isinstance(first, list) else first)[:num_chars]
    return str(raw or "")[:num_chars]
