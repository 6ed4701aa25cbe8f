"""The ``x-ratelimit-*`` headers OpenAI clients read (docs/WIRE.md §2)."""

from __future__ import annotations

import math

from admission.quota import QuotaSnapshot


def ratelimit_headers(snapshot: QuotaSnapshot) -> dict[str, str]:
    """Limit, remaining and time-until-full for requests and tokens; an unlimited dimension
    has no headers."""
    headers: dict[str, str] = {}
    if snapshot.limit_requests is not None:
        headers["x-ratelimit-limit-requests"] = str(snapshot.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(snapshot.remaining_requests or 0)
        headers["x-ratelimit-reset-requests"] = duration(snapshot.reset_requests_s)
    if snapshot.limit_tokens is not None:
        headers["x-ratelimit-limit-tokens"] = str(snapshot.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(snapshot.remaining_tokens or 0)
        headers["x-ratelimit-reset-tokens"] = duration(snapshot.reset_tokens_s)
    return headers


def duration(seconds: float) -> str:
    """OpenAI's duration strings: ``12ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{math.ceil(max(0.0, seconds) * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    total = math.ceil(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"
