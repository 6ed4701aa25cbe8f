"""Whether to split a request across a prefill and a decode worker, or serve it on one.

Splitting pays a second hop and a KV transfer on time to first token; it wins back decode
smoothness (no prefill interference) mostly for long prompts. Short prompts, ``n > 1`` (one
sequence's KV is handed over) and a missing prefill pool run colocated on a decode worker.

A short prompt is split anyway when the decode worker is busy enough that its prefill would
cost the others more than the hand-off costs it (``interference_budget``): a colocated prefill
runs inside the decode worker's next step, so every stream running there waits for it. On a
CPU worker a 67-token prefill stretched that step from ~0.1 s to ~0.5 s (measured in issue 19's
flood); compute-bound prefill scales with its tokens, and the stall is paid once per running
stream.
A prompt's length is admission's count of it (``admission.tokens.estimate_tokens``): the two
cannot disagree on how long a prompt is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from core.messages import ServingPath


class Reason(enum.StrEnum):
    """Why a request took its path (a metric label)."""

    LONG_PROMPT = "long_prompt"
    SHORT_PROMPT = "short_prompt"
    BUSY_DECODE = "busy_decode"  # short, but its prefill would stall many running streams
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
    """Prompt tokens (admission's estimate) below which a request runs colocated (0: always
    split)."""
    interference_budget: int = 0
    """Split a prompt under ``min_prompt_tokens`` anyway when prompt tokens x requests in flight
    on the chosen decode worker reach this (the token-streams its colocated prefill would stall);
    0: never. ``tandem up`` uses 512: with 8 streams running, prompts from 64 tokens split while
    a 34-token chat question stays on the shortest path."""
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


@dataclass(frozen=True, slots=True)
class Decision:
    path: ServingPath
    reason: Reason


def decide(
    prompt_tokens: int,
    num_choices: int,
    config: DeciderConfig,
    *,
    has_prefill_pool: bool,
    prefill_healthy: bool,
    decode_in_flight: int = 0,
) -> Decision:
    """The path for a request of ``prompt_tokens`` (admission's estimate) asking for
    ``num_choices`` (its ``n``), given the pools' state now: ``decode_in_flight`` requests
    running on the decode worker it would share."""
    if not has_prefill_pool:
        return Decision(ServingPath.COLOCATED, Reason.NO_PREFILL_POOL)
    if num_choices > 1:
        return Decision(ServingPath.COLOCATED, Reason.MULTIPLE_CHOICES)
    reason = Reason.LONG_PROMPT
    if prompt_tokens < config.min_prompt_tokens:
        budget = config.interference_budget
        if not budget or prompt_tokens * decode_in_flight < budget:
            return Decision(ServingPath.COLOCATED, Reason.SHORT_PROMPT)
        reason = Reason.BUSY_DECODE
    if not prefill_healthy:
        return Decision(ServingPath.FALLBACK, Reason.NO_HEALTHY_PREFILL)
    return Decision(ServingPath.DISAGGREGATED, reason)
