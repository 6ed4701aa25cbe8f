"""What one benchmark request measured: the per-request record every figure is computed from.

Times are seconds on the load generator's monotonic clock. ``sent_s`` and ``scheduled_s`` are
offsets from the start of the run; ``ttft_s``, ``e2e_s`` and the chunk gaps are relative to the
request's own send. The definitions follow vLLM's ``bench serve`` so the two agree:

- ``ttft_s``: send -> first chunk with a choice, even when it carries only the role (vLLM's TTFT);
- ``ttft_content_s``: send -> first chunk with non-empty text (what a reader sees);
- ``itl_s``: the gaps between consecutive chunks with a choice (vLLM's ITL, one per chunk);
- ``e2e_s``: send -> last chunk with a choice (the usage chunk is not a token);
- TPOT = (E2E - TTFT) / (output tokens - 1), output tokens from the server's usage.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class RequestRecord:
    index: int
    tenant: str
    warmup: bool
    scheduled_s: float | None
    """When the load shape wanted it sent (None: closed loop, sent when a slot was free)."""
    max_tokens: int
    expected_prompt_tokens: int
    """The dataset's count (no chat template); the server's count is ``prompt_tokens``."""
    sent_s: float = 0.0
    elapsed_s: float = 0.0
    """Send -> the end of the response, whatever it was (errors included)."""
    status: int | None = None
    """HTTP status; None when no response came (connection refused, reset, timeout)."""
    error_type: str | None = None
    """Why it failed: the OpenAI error ``type``/``code``, ``connection``, ``timeout``,
    ``stream_error`` (an error event mid-stream) or ``malformed``."""
    error: str | None = None
    malformed: list[str] = field(default_factory=list)
    """Ways the stream broke the protocol (bad SSE, no finish reason, usage not matching)."""
    ttft_s: float | None = None
    ttft_content_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    content_chunks: int = 0
    finish_reason: str | None = None
    queue_ms: float | None = None
    """The gateway's ``x-tandem-queue-ms`` (time in its fair queue), when it reports one."""
    request_id: str | None = None
    text: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_type is None

    @property
    def tpot_s(self) -> float | None:
        """vLLM's TPOT: decode time per token after the first (None under two tokens)."""
        tokens = self.completion_tokens
        if not self.ok or tokens is None or tokens < 2 or self.ttft_s is None:
            return None
        assert self.e2e_s is not None
        return (self.e2e_s - self.ttft_s) / (tokens - 1)

    @property
    def ntpot_s(self) -> float | None:
        """Normalised time per output token: E2E / output tokens, TTFT included (llmperf's)."""
        if not self.ok or not self.completion_tokens or self.e2e_s is None:
            return None
        return self.e2e_s / self.completion_tokens

    @property
    def max_itl_s(self) -> float | None:
        """The longest stall of this stream: what an ITL SLO is checked against."""
        return max(self.itl_s) if self.itl_s else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})
