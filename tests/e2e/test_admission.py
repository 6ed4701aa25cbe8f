"""Tenants and token quotas on the real stack: real vLLM usage drives reconciliation."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import LiveStack

pytestmark = pytest.mark.e2e

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name one colour."}]


def _remaining_tokens(live_stack: LiveStack, tenant: str) -> int:
    with live_stack.admin as admin:
        usage = admin.get(f"/admin/v1/tenants/{tenant}/usage").json()
    return int(usage["tokens"]["remaining"])


def test_quota_headers_refund_and_400_for_requests_that_never_fit(live_stack: LiveStack) -> None:
    key = live_stack.new_tenant("quota-e2e", tpm=6000, rpm=1000)
    client = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key=key, max_retries=0)

    # Streamed, with a generous max_tokens: the reservation is large, real usage small.
    raw = client.chat.completions.with_raw_response.create(
        model=live_stack.model,
        messages=QUESTION,
        max_tokens=400,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert raw.headers["x-ratelimit-limit-tokens"] == "6000"
    reserved_left = int(raw.headers["x-ratelimit-remaining-tokens"])
    chunks = list(raw.parse())
    usage = chunks[-1].usage
    assert usage is not None and usage.total_tokens < 200
    # Reconciled against vLLM's own count: the unused part of max_tokens came back.
    assert (
        _remaining_tokens(live_stack, "quota-e2e")
        >= reserved_left + (200 - usage.total_tokens) - 10
    )

    # More than the whole plan: never admitted, a 400 naming the field (the SDK never retries
    # it); more than the model's context window likewise, before any quota is reserved.
    with pytest.raises(openai.BadRequestError) as caught:  # 6 x 1000 tokens and the prompt
        client.chat.completions.create(
            model=live_stack.model, messages=QUESTION, max_tokens=1000, n=6
        )
    assert (caught.value.code, caught.value.param) == ("request_too_large", "max_tokens")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=live_stack.model, messages=QUESTION, max_tokens=10_000_000
        )
    assert (caught.value.code, caught.value.param) == ("max_tokens_too_large", "max_tokens")


@pytest.mark.parametrize(
    "messages",
    [
        QUESTION,  # the template adds its default system message
        [{"role": "system", "content": "Answer in one word."}, *QUESTION],
        [*QUESTION, {"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}],
    ],
    ids=["user", "system-led", "three-turns"],
)
def test_a_chat_reservation_holds_the_prompt_vllm_counts(
    live_stack: LiveStack, messages: list[ChatCompletionMessageParam]
) -> None:
    """Priced with the model's chat template, a reservation is never short of the engine's
    prompt: a reconcile lost to a store outage then cannot let a tenant past its TPM."""
    tenant = f"template-{len(messages)}-{messages[0]['role']}"
    key = live_stack.new_tenant(tenant, tpm=6000)
    client = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key=key, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=live_stack.model, messages=messages, max_tokens=4, temperature=0
    )
    reserved_prompt = 6000 - int(raw.headers["x-ratelimit-remaining-tokens"]) - 4
    usage = raw.parse().usage
    assert usage is not None
    # Over by at most the rounding of half a token a message (``admission.chat_template``).
    assert usage.prompt_tokens <= reserved_prompt <= usage.prompt_tokens + len(messages) + 1


def test_unknown_key_is_401_on_the_real_stack(live_stack: LiveStack) -> None:
    response = httpx.post(
        f"{live_stack.base_url}/v1/chat/completions",
        json={"model": live_stack.model, "messages": QUESTION},
        headers={"Authorization": "Bearer tdm-not-a-key"},
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
