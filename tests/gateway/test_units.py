"""Pure units of the gateway: validation, error mapping, worker selection, chunk splitting."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from core.errors import ContextLengthExceededError, EngineError, InvalidRequestError
from core.messages import WorkerRole
from gateway.errors import invalid_request_from_validation
from gateway.serving.relay import split_finish_chunk
from gateway.serving.schemas import (
    QUICK_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    plainly_valid,
    validate_request,
)
from gateway.serving.upstream import engine_status_error
from workers.registry import Worker, least_loaded

MESSAGES = [{"role": "user", "content": "hi"}]


def _param_of(schema: type[ChatCompletionRequest | CompletionRequest], body: dict) -> str | None:
    with pytest.raises(ValidationError) as caught:
        validate_request(schema, body)
    return invalid_request_from_validation(caught.value).param


@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_the_quick_check_knows_every_field_the_model_declares(
    schema: type[ChatCompletionRequest | CompletionRequest],
) -> None:
    """A field added to a model and not to the quick check would pass it unchecked, as an
    unknown field does (tests/properties/test_request_validation_properties.py)."""
    assert set(schema.model_fields) == QUICK_FIELDS[schema]


@pytest.mark.parametrize(
    ("schema", "body"),
    [
        (ChatCompletionRequest, {"model": "m", "messages": MESSAGES}),
        (
            ChatCompletionRequest,
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                    {"role": "assistant", "content": None, "tool_calls": []},
                ],
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_completion_tokens": 64,
                "temperature": 0.7,
                "top_p": 1,
                "n": 1,
                "stop": ["\n"],
                "user": "u1",
                "seed": 7,
            },
        ),
        (CompletionRequest, {"model": "m", "prompt": "hi", "max_tokens": 16, "logprobs": 2}),
    ],
)
def test_an_sdks_usual_request_is_checked_without_the_model(
    schema: type[ChatCompletionRequest | CompletionRequest], body: dict
) -> None:
    assert plainly_valid(schema, body)
    validate_request(schema, body)


def test_validate_request_still_limits_the_depth_of_unknown_fields() -> None:
    deep: list = []
    for _ in range(100):
        deep = [deep]
    body = {"model": "m", "messages": MESSAGES, "extra": deep}
    with pytest.raises(InvalidRequestError) as caught:
        validate_request(ChatCompletionRequest, body)
    assert caught.value.code == "json_too_deep"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES}, "model"),
        ({"model": "", "messages": MESSAGES}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"content": "x"}]}, "messages.0.role"),
        ({"model": "m", "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
        (
            {"model": "m", "messages": MESSAGES, "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
        ({"model": "m", "messages": MESSAGES, "temperature": 3}, "temperature"),
        ({"model": "m", "messages": MESSAGES, "n": 0}, "n"),
        ({"model": "m", "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (
            {"model": "m", "messages": MESSAGES, "stream_options": {"include_usage": True}},
            "stream_options",
        ),
    ],
)
def test_chat_validation_names_the_field(body: dict, param: str | None) -> None:
    found = _param_of(ChatCompletionRequest, body)
    assert found == param or (param is not None and found is not None and found.startswith(param))


def test_chat_accepts_unknown_fields_and_content_parts() -> None:
    ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "top_k": 3,
            "stop": "x",
            "safety_identifier": "u1",
        }
    )


@pytest.mark.parametrize(
    ("prompt", "ok"), [("hi", True), (["a", "b"], True), ([1, 2], True), ([], False), (None, False)]
)
def test_completion_prompt_forms(prompt: object, ok: bool) -> None:
    body = {"model": "m", "prompt": prompt}
    if ok:
        CompletionRequest.model_validate(body)
    else:
        assert _param_of(CompletionRequest, body) is not None or prompt == []


def test_completion_logprobs_range() -> None:
    assert _param_of(CompletionRequest, {"model": "m", "prompt": "x", "logprobs": 6}) == "logprobs"


def test_engine_400_about_context_becomes_context_length_exceeded() -> None:
    worker = Worker("d0", WorkerRole.DECODE, "http://x")
    body = (
        b'{"error":{"message":"This model\'s maximum context length is 1024 tokens. However, '
        b'your prompt contains 2000 input tokens","type":"BadRequestError","param":"input_tokens",'
        b'"code":400}}'
    )
    error = engine_status_error(worker, "/v1/chat/completions", 400, body)
    assert isinstance(error, ContextLengthExceededError)
    assert error.param == "messages" and error.code == "context_length_exceeded"
    assert engine_status_error(worker, "/v1/completions", 400, body).param == "prompt"


def test_other_engine_answers_map_to_400_or_502() -> None:
    worker = Worker("d0", WorkerRole.DECODE, "http://x")
    bad = engine_status_error(worker, "/v1/completions", 400, b'{"error":{"message":"bad top_k"}}')
    assert isinstance(bad, InvalidRequestError) and bad.message == "bad top_k"
    crash = engine_status_error(worker, "/v1/completions", 500, b'{"error":{"code":500}}')
    assert isinstance(crash, EngineError) and crash.status_code == 502
    assert "d0" in crash.message and "500" in crash.message
    junk = engine_status_error(worker, "/v1/completions", 503, b"<html>oops</html>")
    assert junk.status_code == 502 and "oops" in junk.message


def test_least_loaded_skips_unhealthy_and_prefers_idle() -> None:
    a = Worker("a", WorkerRole.DECODE, "http://a", healthy=True, num_outstanding=3)
    b = Worker("b", WorkerRole.DECODE, "http://b", healthy=False, num_outstanding=0)
    c = Worker("c", WorkerRole.DECODE, "http://c", healthy=True, num_outstanding=1)
    assert least_loaded([a, b, c]) is c
    assert least_loaded([b]) is None
    assert least_loaded([]) is None
    with c.lease(), c.lease():
        assert c.num_outstanding == 3
        assert least_loaded([a, c]) is a  # tie: first listed
    assert c.num_outstanding == 1


def test_finish_reason_is_split_from_the_last_token() -> None:
    chunk = {
        "id": "x",
        "choices": [{"index": 0, "delta": {"content": " end"}, "finish_reason": "length"}],
    }
    content, final = split_finish_chunk(chunk, "delta")
    assert content["choices"][0] == {
        "index": 0,
        "delta": {"content": " end"},
        "finish_reason": None,
        "stop_reason": None,
    }
    assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "length"
    text_chunk = {"choices": [{"index": 0, "text": "!", "finish_reason": "stop"}]}
    assert [c["choices"][0]["text"] for c in split_finish_chunk(text_chunk, "text")] == ["!", ""]
    empty_final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    assert split_finish_chunk(empty_final, "delta") == [empty_final]


def test_engine_400_for_too_many_output_tokens_names_max_tokens() -> None:
    worker = Worker("d0", WorkerRole.DECODE, "http://x")
    body = (
        b'{"error":{"message":"max_tokens=5000 cannot be greater than max_model_len=1024. '
        b'Please request fewer output tokens.","code":400}}'
    )
    error = engine_status_error(worker, "/v1/chat/completions", 400, body)
    assert isinstance(error, ContextLengthExceededError)
    assert error.param == "max_tokens"
