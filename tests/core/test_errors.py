from __future__ import annotations

import pytest

from core.errors import (
    BodyTooLargeError,
    ContextLengthExceededError,
    EngineError,
    EngineTimeoutError,
    HeadersTooLargeError,
    InvalidRequestError,
    ModelNotFoundError,
    NoHealthyWorkerError,
    RequestTimeoutError,
    TandemError,
)


@pytest.mark.parametrize(
    ("error", "status", "error_type", "code"),
    [
        (InvalidRequestError("bad"), 400, "invalid_request_error", None),
        (
            ContextLengthExceededError("long"),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (ModelNotFoundError("nope"), 404, "invalid_request_error", "model_not_found"),
        (RequestTimeoutError("slow"), 408, "invalid_request_error", "request_timeout"),
        (BodyTooLargeError("big"), 413, "invalid_request_error", "body_too_large"),
        (HeadersTooLargeError("big"), 431, "invalid_request_error", "headers_too_large"),
        (NoHealthyWorkerError("busy"), 503, "service_unavailable", "no_healthy_worker"),
        (EngineError("boom"), 502, "api_error", "engine_error"),
        (EngineTimeoutError("slow"), 504, "api_error", "engine_timeout"),
        (TandemError("bug"), 500, "api_error", "internal_error"),
    ],
)
def test_each_error_renders_an_openai_body(
    error: TandemError, status: int, error_type: str, code: str | None
) -> None:
    assert error.status_code == status
    assert error.to_body() == {
        "error": {"message": error.message, "type": error_type, "param": None, "code": code}
    }


def test_retry_hints_become_headers() -> None:
    error = NoHealthyWorkerError("busy", retry_after_s=2.4, should_retry=True)
    assert error.headers() == {
        "retry-after": "2",
        "retry-after-ms": "2400",
        "x-should-retry": "true",
    }
    assert NoHealthyWorkerError("busy", retry_after_s=0.2).headers()["retry-after"] == "1"
    assert EngineError("x").headers() == {}
