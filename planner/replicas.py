"""How many prefill and decode workers a load needs, pool by pool (Dynamo's model, from a
measured profile, corrected by what is observed):

    prefill = ceil( (rate x input tokens + backlog / interval) x max(1, TTFT / target)
                    / (one worker's prefill tokens/s at that prompt length x headroom) )
    decode  = ceil( rate x output tokens x ITL target            (Little's law: streams at once)
                    x max(1, ITL / target)
                    / (one worker's concurrency within the ITL target x headroom) )

The corrections only ever add: a latency above its target means the profile is optimistic
here (interference, a busy host); one below it is not taken as a reason to remove a worker the
load still needs. The prefill correction is left out while prompts are queued: the backlog
term already answers for them. A request waiting for its first token needs at least one decode
worker. No traffic needs no worker; the pool's floor is the scaling policy's business
(``scaling``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.profile import Profile

MAX_CORRECTION = 4.0
"""The most a latency miss multiplies a pool by in one interval (a stuck worker's TTFT says
little about how many workers are needed)."""


@dataclass(frozen=True, slots=True)
class Load:
    """One interval's traffic to a version, predicted or observed."""

    request_rate: float
    """Requests per second."""
    input_tokens: float
    """Mean prompt tokens per request."""
    output_tokens: float
    """Mean output tokens per request."""
    prefill_backlog_tokens: float = 0.0
    """Prompt tokens queued or prefilling now, to be worked off within the next interval."""
    waiting_requests: int = 0
    """Requests waiting for their first token now (in the backlog)."""


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float
    itl_s: float
    headroom: float = 0.8
    """The share of a worker's measured capacity the planner plans to use."""
    kv_usage: float = 0.9
    """Mean KV-cache usage of a decode pool's workers from which it gets one more worker
    (``loop.Planner``)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What the last interval showed (None: no request to judge by)."""

    ttft_s: float | None = None
    itl_s: float | None = None


@dataclass(frozen=True, slots=True)
class Needed:
    prefill: int
    decode: int
    prefill_correction: float
    decode_correction: float


def correction(observed: float | None, target: float) -> float:
    """How much a pool should grow for a latency over its target (1 when met or unknown)."""
    if observed is None or target <= 0:
        return 1.0
    return min(max(observed / target, 1.0), MAX_CORRECTION)


def needed(
    load: Load, profile: Profile, targets: Targets, observed: Observed, interval_s: float
) -> Needed:
    """The workers each pool needs for ``load`` (module docstring)."""
    # A backlog is the queue itself, measured (its term below works it off): a TTFT inflated by
    # waiting in it would count the same shortfall twice (Dynamo's planner caps its prefill
    # correction at 1 for that reason). Without one, a slow TTFT means slower prefills than
    # the profile's.
    prefill_fix = (
        1.0 if load.prefill_backlog_tokens > 0 else correction(observed.ttft_s, targets.ttft_s)
    )
    decode_fix = correction(observed.itl_s, targets.itl_s)
    prompt_tokens_per_s = load.request_rate * load.input_tokens + (
        load.prefill_backlog_tokens / interval_s
    )
    prefill = 0
    if prompt_tokens_per_s > 0:
        per_worker = profile.prefill_tokens_per_s(load.input_tokens) * targets.headroom
        prefill = _ceil(prompt_tokens_per_s * prefill_fix / per_worker)
    streams = load.request_rate * load.output_tokens * targets.itl_s
    decode = 0
    if streams > 0:
        per_worker = profile.decode_concurrency(targets.itl_s) * targets.headroom
        decode = _ceil(streams * decode_fix / per_worker)
    if load.waiting_requests:
        # A request waiting needs a worker to decode it, whatever the rate says: this is how a
        # pool scaled to zero comes back for the first request.
        decode = max(decode, 1)
    return Needed(prefill, decode, prefill_fix, decode_fix)


def _ceil(workers: float) -> int:
    """Whole workers, without a float's last bit (2.0000000001) costing a third."""
    return math.ceil(workers - 1e-9)
