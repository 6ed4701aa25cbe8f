"""The ledger on the real stack: vLLM's own usage (cached prompt tokens included) is what
gets recorded and priced, for streamed and non-streamed requests."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import LiveStack, ledger_rows

pytestmark = pytest.mark.e2e

# Long enough to fill prefix-cache blocks, so the repeat is served partly from vLLM's cache.
PROMPT = [{"role": "user", "content": "Summarise this: " + "the quick brown fox jumps. " * 60}]


def test_real_usage_is_recorded_and_priced(live_stack: LiveStack) -> None:
    key = live_stack.new_tenant("billing-e2e")
    client = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key=key, max_retries=0)
    first = client.chat.completions.create(
        model=live_stack.model,
        messages=PROMPT,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    (row,) = ledger_rows(live_stack, "billing-e2e")
    version = row["model_version"]
    assert version == first.model == live_stack.version  # alias@8hex: the version that served it
    assert first.usage is not None
    assert int(row["prompt_tokens"]) == first.usage.prompt_tokens
    assert int(row["completion_tokens"]) == first.usage.completion_tokens
    assert row["cost_micros"] == "0" and row["price_effective_from_us"] == ""  # no card yet

    with live_stack.admin as admin:
        card = {"model_version": version, "input_per_1k": "1", "output_per_1k": "2",
                "cached_input_per_1k": "0.5"}  # fmt: skip
        assert admin.post("/admin/v1/billing/prices", json=card).status_code == 201
    stream = client.chat.completions.create(
        model=live_stack.model, messages=PROMPT, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    rows = ledger_rows(live_stack, "billing-e2e")
    assert len(rows) == 2
    second = rows[1]
    cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage.prompt_tokens_details else 0
    assert int(second["prompt_tokens"]) == usage.prompt_tokens
    assert int(second["completion_tokens"]) == usage.completion_tokens
    assert int(second["cached_tokens"]) == cached
    # $1 per 1k uncached, $0.50 per 1k cached, $2 per 1k output, in micros.
    expected = (usage.prompt_tokens - cached) * 1000 + cached * 500 + usage.completion_tokens * 2000
    assert int(second["cost_micros"]) == expected
    assert second["status"] == "completed"
    assert second["path"] in {"disaggregated", "colocated"}
    assert int(second["ttft_us"]) > 0
