"""End-to-end through the gateway with the official ``openai`` client, on real vLLM workers."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import DEFAULT_MAX_TOKENS, MAX_MODEL_LEN, LiveStack

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_list(client: openai.OpenAI, live_stack: LiveStack) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [live_stack.model]
    assert models.data[0].object == "model"
    assert models.data[0].owned_by == "tandem"
    assert models.data[0].model_extra is not None
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert models.data[0].model_extra["default_max_tokens"] == DEFAULT_MAX_TOKENS


def test_a_chat_stream_without_max_tokens_stops_at_the_default_cap(
    client: openai.OpenAI, live_stack: LiveStack
) -> None:
    """The README's example sends no max_tokens: without a cap it once streamed for minutes."""
    stream = client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finish_reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish_reasons[-1] in ("length", "stop")
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= DEFAULT_MAX_TOKENS


def test_chat_non_streaming(client: openai.OpenAI, live_stack: LiveStack) -> None:
    completion = client.chat.completions.create(
        model=live_stack.model, messages=QUESTION, max_tokens=24, temperature=0
    )
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    # Greedy, on the workers' default float32: the bundled model knows this one.
    assert "Paris" in (choice.message.content or "")
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 5
    assert completion.usage.completion_tokens >= 1


def test_chat_stream_without_usage(client: openai.OpenAI, live_stack: LiveStack) -> None:
    chunks = list(
        client.chat.completions.create(
            model=live_stack.model, messages=QUESTION, max_tokens=24, temperature=0, stream=True
        )
    )
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert len({chunk.created for chunk in chunks}) == 1
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks)
    assert "Paris" in text


def test_chat_stream_with_usage(client: openai.OpenAI, live_stack: LiveStack) -> None:
    chunks = list(
        client.chat.completions.create(
            model=live_stack.model,
            messages=QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage_chunks = [chunk for chunk in chunks if chunk.usage is not None]
    assert usage_chunks == [chunks[-1]], "exactly one usage chunk, the last one"
    assert chunks[-1].choices == []
    content_chunks = chunks[:-1]
    assert content_chunks[-1].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1].usage
    assert usage is not None
    assert (
        usage.completion_tokens
        == sum(1 for chunk in content_chunks if chunk.choices[0].delta.content)
        or usage.completion_tokens >= 1
    )
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_max_tokens_cap_gives_length(client: openai.OpenAI, live_stack: LiveStack) -> None:
    stream = client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


def test_completions(client: openai.OpenAI, live_stack: LiveStack) -> None:
    completion = client.completions.create(
        model=live_stack.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.choices[0].text
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage is not None and completion.usage.completion_tokens >= 1


def test_completions_streaming(client: openai.OpenAI, live_stack: LiveStack) -> None:
    chunks = list(
        client.completions.create(
            model=live_stack.model,
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(chunk.choices[0].text for chunk in chunks)


def _assert_openai_error(response: httpx.Response, status: int, code: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def test_bad_json_is_400(live_stack: LiveStack) -> None:
    response = httpx.post(
        f"{live_stack.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {live_stack.api_key}",
        },
    )
    error = _assert_openai_error(response, 400, None)
    assert error["type"] == "invalid_request_error"


def test_missing_field_is_400_naming_it(client: openai.OpenAI, live_stack: LiveStack) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=live_stack.model, messages=[])
    assert caught.value.body["param"] == "messages"  # type: ignore[index]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert caught.value.code == "model_not_found"


def test_prompt_longer_than_context_is_400(client: openai.OpenAI, live_stack: LiveStack) -> None:
    long_prompt = "hello " * (live_stack.max_model_len + 100)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=live_stack.model,
                messages=[{"role": "user", "content": long_prompt}],
                max_tokens=4,
                stream=stream,
            )
        assert caught.value.code == "context_length_exceeded"
        assert caught.value.param == "messages"
