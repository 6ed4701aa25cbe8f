"""Tandem's error hierarchy. Every error a client can see is one of these.

Each error knows how it leaves the gateway: HTTP status, the OpenAI error ``type``, ``code`` and
``param``, and retry hints the OpenAI SDKs obey (``retry-after``, ``x-should-retry``). The gateway
renders them in one handler; a stream that already started carries them as one ``error`` event.

    TandemError                      500 api_error
    ├── InvalidRequestError          400 invalid_request_error
    │   └── ContextLengthExceededError   400 code=context_length_exceeded
    ├── AuthenticationError          401 authentication_error
    ├── ModelNotFoundError           404 code=model_not_found
    ├── NoHealthyWorkerError         503 code=no_healthy_worker, retry-after
    └── EngineError                  502 code=engine_error (a worker failed or answered junk)
        └── EngineTimeoutError       504 code=engine_timeout
"""

from __future__ import annotations

from typing import Any


class TandemError(Exception):
    """Base of every error Tandem reports to a client."""

    status_code: int = 500
    error_type: str = "api_error"
    default_code: str | None = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error body: all four keys, ``code`` a string or null, never an int."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Retry hints for the OpenAI SDKs (they read these before the status code)."""
        headers: dict[str, str] = {}
        if self.retry_after_s is not None:
            # Whole seconds for `retry-after`; `retry-after-ms` keeps the precision.
            headers["retry-after"] = str(max(1, round(self.retry_after_s)))
            headers["retry-after-ms"] = str(max(1, round(self.retry_after_s * 1000)))
        if self.should_retry is not None:
            headers["x-should-retry"] = "true" if self.should_retry else "false"
        return headers


class InvalidRequestError(TandemError):
    """The request is malformed or asks for something impossible; the client must change it."""

    status_code = 400
    error_type = "invalid_request_error"
    default_code: str | None = None


class ContextLengthExceededError(InvalidRequestError):
    """The prompt (plus requested output) does not fit the model's context window."""

    default_code = "context_length_exceeded"


class AuthenticationError(TandemError):
    """Missing, unknown or revoked API key."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class ModelNotFoundError(TandemError):
    """The requested model is not served by this gateway."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class NoHealthyWorkerError(TandemError):
    """No worker of a pool can take the request right now; retrying later may succeed."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "no_healthy_worker"


class EngineError(TandemError):
    """A worker failed, was unreachable, or answered something that is not vLLM's protocol."""

    status_code = 502
    error_type = "api_error"
    default_code = "engine_error"


class EngineTimeoutError(EngineError):
    """A worker did not answer within the request's time budget."""

    status_code = 504
    default_code = "engine_timeout"
