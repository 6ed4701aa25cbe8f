"""Whether to split a request across a prefill and a decode worker, or serve it on one.

Splitting pays a second hop and a KV transfer on time to first token; it wins back decode
smoothness (no prefill interference) mostly for long prompts. Short prompts, ``n > 1`` (one
sequence's KV is handed over) and a missing prefill pool run colocated on a decode worker.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from core.messages import ServingPath

# A cheap, tokenizer-free estimate: English averages ~4 characters per token. The engine's
# exact count arrives with the usage; admission will count precisely (issue 5).
_CHARS_PER_TOKEN = 4


class Reason(enum.StrEnum):
    """Why a request took its path (a metric label)."""

    LONG_PROMPT = "long_prompt"
    SHORT_PROMPT = "short_prompt"
    MULTIPLE_CHOICES = "n_gt_1"
    NO_PREFILL_POOL = "no_prefill_pool"
    NO_HEALTHY_PREFILL = "no_healthy_prefill"
    PREFILL_FAILED = "prefill_failed"
    DECODE_FAILED = "decode_failed"  # the decode leg failed before its first byte; re-run
    KV_EXPIRED = "kv_expired"  # the prefill worker's lease on the KV ran out before leg 2
    # The prefill worker holding the KV left rotation before the decode worker read it.
    PREFILL_LOST = "prefill_lost"


@dataclass(frozen=True, slots=True)
class DeciderConfig:
    """When to disaggregate."""

    min_prompt_tokens: int = 256
    """Estimated prompt tokens below which a request runs colocated (0: always split)."""
    affinity_prefix_chars: int = 256
    """Prompt characters that decide which prefill worker a request prefers (prefix cache).
    Short on purpose: requests sharing only their start (a system prompt) still meet, and
    ~64 tokens are already four KV blocks a cache can skip."""
    affinity_max_extra_load: int = 2
    """How many more in-flight requests than the least-loaded prefill worker the preferred one
    may have before load wins over cache affinity."""
    kv_source_check_s: float = 0.2
    """How often a decode leg waiting for its first byte checks that the prefill worker holding
    its KV is still in rotation; when it is not, the request is re-run colocated at once."""
    kv_lease_s: float = 10.0
    """How long prefill workers keep KV nobody read (``ConnectorConfig.kv_lease_s``): a
    handle older than this is not sent to a decode worker, which would recompute anyway."""


@dataclass(frozen=True, slots=True)
class Decision:
    path: ServingPath
    reason: Reason


def decide(
    body: dict[str, Any], config: DeciderConfig, *, has_prefill_pool: bool, prefill_healthy: bool
) -> Decision:
    """The path for ``body`` given the pools' state now."""
    if not has_prefill_pool:
        return Decision(ServingPath.COLOCATED, Reason.NO_PREFILL_POOL)
    if int(body.get("n") or 1) > 1:
        return Decision(ServingPath.COLOCATED, Reason.MULTIPLE_CHOICES)
    if estimate_prompt_tokens(body) < config.min_prompt_tokens:
        return Decision(ServingPath.COLOCATED, Reason.SHORT_PROMPT)
    if not prefill_healthy:
        return Decision(ServingPath.FALLBACK, Reason.NO_HEALTHY_PREFILL)
    return Decision(ServingPath.DISAGGREGATED, Reason.LONG_PROMPT)


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Rough prompt length of a chat or completions body, in tokens."""
    if "messages" in body:
        return sum(_text_length(message.get("content")) for message in body["messages"]) // (
            _CHARS_PER_TOKEN
        ) + 4 * len(body["messages"])  # role markers of the chat template
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return len(prompt)  # already token ids
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        return max(len(ids) for ids in prompt)
    if isinstance(prompt, list):
        return max(_text_length(p) for p in prompt) // _CHARS_PER_TOKEN
    return _text_length(prompt) // _CHARS_PER_TOKEN


def _text_length(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # content parts
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0
