from __future__ import annotations

import pytest

from core.messages import ServingPath
from kv_transfer.decider import DeciderConfig, Reason, decide, estimate_prompt_tokens

LONG = "word " * 400  # ~500 estimated tokens
CONFIG = DeciderConfig(min_prompt_tokens=256)


def chat(text: str, **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.parametrize(
    ("body", "has_pool", "healthy", "path", "reason"),
    [
        (chat(LONG), True, True, ServingPath.DISAGGREGATED, Reason.LONG_PROMPT),
        (chat("Hi"), True, True, ServingPath.COLOCATED, Reason.SHORT_PROMPT),
        (chat(LONG, n=2), True, True, ServingPath.COLOCATED, Reason.MULTIPLE_CHOICES),
        (chat(LONG), False, False, ServingPath.COLOCATED, Reason.NO_PREFILL_POOL),
        (chat(LONG), True, False, ServingPath.FALLBACK, Reason.NO_HEALTHY_PREFILL),
    ],
)
def test_decisions(
    body: dict, has_pool: bool, healthy: bool, path: ServingPath, reason: Reason
) -> None:
    decision = decide(body, CONFIG, has_prefill_pool=has_pool, prefill_healthy=healthy)
    assert (decision.path, decision.reason) == (path, reason)


def test_threshold_zero_always_splits() -> None:
    decision = decide(
        chat("Hi"), DeciderConfig(min_prompt_tokens=0), has_prefill_pool=True, prefill_healthy=True
    )
    assert decision.path is ServingPath.DISAGGREGATED


def test_estimates() -> None:
    assert estimate_prompt_tokens(chat("x" * 400)) == 104  # 100 + the role markers
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 40}]}]}
    assert estimate_prompt_tokens(parts) == 14
    assert estimate_prompt_tokens({"prompt": "z" * 80}) == 20
    assert estimate_prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert estimate_prompt_tokens({"prompt": [[1, 2], [1, 2, 3, 4]]}) == 4
    assert estimate_prompt_tokens({"prompt": ["a" * 8, "b" * 40]}) == 10
