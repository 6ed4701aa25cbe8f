from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from admission.tokens import TokenizerCounter, estimate_tokens
from core.messages import Endpoint, ServingPath
from core.prompt import Prompt
from kv_transfer.decider import DeciderConfig, Reason, decide

LONG = 500  # prompt tokens, as admission counted them
SHORT = 10
CONFIG = DeciderConfig(min_prompt_tokens=256)


@pytest.mark.parametrize(
    ("prompt_tokens", "n", "has_pool", "healthy", "path", "reason"),
    [
        (LONG, 1, True, True, ServingPath.DISAGGREGATED, Reason.LONG_PROMPT),
        (SHORT, 1, True, True, ServingPath.COLOCATED, Reason.SHORT_PROMPT),
        (LONG, 2, True, True, ServingPath.COLOCATED, Reason.MULTIPLE_CHOICES),
        (LONG, 1, False, False, ServingPath.COLOCATED, Reason.NO_PREFILL_POOL),
        (LONG, 1, True, False, ServingPath.FALLBACK, Reason.NO_HEALTHY_PREFILL),
    ],
)
def test_decisions(
    prompt_tokens: int, n: int, has_pool: bool, healthy: bool, path: ServingPath, reason: Reason
) -> None:
    decision = decide(prompt_tokens, n, CONFIG, has_prefill_pool=has_pool, prefill_healthy=healthy)
    assert (decision.path, decision.reason) == (path, reason)


def test_threshold_zero_always_splits() -> None:
    decision = decide(
        SHORT, 1, DeciderConfig(min_prompt_tokens=0), has_prefill_pool=True, prefill_healthy=True
    )
    assert decision.path is ServingPath.DISAGGREGATED


@pytest.mark.parametrize(
    ("prompt_tokens", "in_flight", "healthy", "path", "reason"),
    [
        # 67 x 8 = 536 token-streams stalled: over the budget, split though short.
        (67, 8, True, ServingPath.DISAGGREGATED, Reason.BUSY_DECODE),
        (34, 10, True, ServingPath.COLOCATED, Reason.SHORT_PROMPT),  # 340: cheap to colocate
        (67, 2, True, ServingPath.COLOCATED, Reason.SHORT_PROMPT),  # a quiet decode worker
        (64, 8, True, ServingPath.DISAGGREGATED, Reason.BUSY_DECODE),  # exactly the budget
        (67, 8, False, ServingPath.FALLBACK, Reason.NO_HEALTHY_PREFILL),
        (LONG, 0, True, ServingPath.DISAGGREGATED, Reason.LONG_PROMPT),
    ],
)
def test_a_busy_decode_worker_splits_short_prompts_past_the_interference_budget(
    prompt_tokens: int, in_flight: int, healthy: bool, path: ServingPath, reason: Reason
) -> None:
    config = DeciderConfig(min_prompt_tokens=256, interference_budget=512)
    decision = decide(
        prompt_tokens, 1, config,
        has_prefill_pool=True, prefill_healthy=healthy, decode_in_flight=in_flight,
    )  # fmt: skip
    assert (decision.path, decision.reason) == (path, reason)


def test_without_an_interference_budget_load_never_splits_a_short_prompt() -> None:
    decision = decide(
        SHORT, 1, CONFIG, has_prefill_pool=True, prefill_healthy=True, decode_in_flight=10_000
    )
    assert decision.path is ServingPath.COLOCATED


@pytest.fixture(scope="module")
def word_counter(tmp_path_factory: pytest.TempPathFactory) -> TokenizerCounter:
    """A real tokenizer file whose tokens are words: counts are known exactly."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "word": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path: Path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return TokenizerCounter(path)


@pytest.mark.parametrize(
    ("endpoint", "body", "tokens"),
    [
        # Each entry is under the threshold (256), their sum is over it: a decider that took
        # the largest entry would keep these colocated while admission reserved the sum.
        (Endpoint.COMPLETIONS, {"prompt": ["word " * 150, "word " * 150]}, 300),
        (Endpoint.COMPLETIONS, {"prompt": [[7] * 150, [8] * 150]}, 300),
        # 600 characters of one-letter words: 300 tokens, where 4 chars/token makes 150.
        (Endpoint.COMPLETIONS, {"prompt": "a " * 300}, 300),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": "word " * 150}] * 2},
            300 + 2 * 4 + 3,  # the chat template's tokens per message and reply priming
        ),
    ],
)
async def test_admission_count_decides_the_split(
    word_counter: TokenizerCounter, endpoint: Endpoint, body: dict[str, Any], tokens: int
) -> None:
    body = {"model": "m", **body}
    estimate = await estimate_tokens(
        endpoint, body, Prompt.parse(endpoint, body), word_counter, None
    )
    assert estimate.prompt_tokens == tokens

    def path(min_prompt_tokens: int) -> ServingPath:
        config = DeciderConfig(min_prompt_tokens=min_prompt_tokens)
        return decide(
            estimate.prompt_tokens, estimate.num_choices, config,
            has_prefill_pool=True, prefill_healthy=True,
        ).path  # fmt: skip

    assert path(256) is ServingPath.DISAGGREGATED
    assert path(tokens) is ServingPath.DISAGGREGATED
    assert path(tokens + 1) is ServingPath.COLOCATED
