"""Frozen messages that cross process or network boundaries (or are shared between packages)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class WorkerRole(enum.StrEnum):
    """What a vLLM worker does in the disaggregated pair."""

    PREFILL = "prefill"
    DECODE = "decode"


class ServingPath(enum.StrEnum):
    """How a request was served; recorded per request for metrics and billing."""

    DISAGGREGATED = "disaggregated"  # prefill worker, KV over NIXL, decode worker
    COLOCATED = "colocated"  # one decode worker did prefill and decode, by choice
    FALLBACK = "fallback"  # meant to split, but the prefill side failed: served colocated


class Endpoint(enum.StrEnum):
    """The OpenAI routes Tandem relays to the engines."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as the engine reported them."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object (``prompt_tokens_details`` only when some were cached)."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
        }
        if self.cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    @classmethod
    def from_openai(cls, usage: dict[str, Any]) -> Usage:
        """Read an OpenAI ``usage`` object (vLLM's, possibly with prompt_tokens_details)."""
        details = usage.get("prompt_tokens_details") or {}
        return cls(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
        )
