"""Tandem's error hierarchy. Every error a client can see is one of these.

Each error knows how it leaves the gateway: HTTP status, the OpenAI error ``type``, ``code`` and
``param``, and retry hints the OpenAI SDKs obey (``retry-after``, ``x-should-retry``). The gateway
renders them in one handler; a stream that already started carries them as one ``error`` event.

    TandemError                      500 api_error
    ├── InvalidRequestError          400 invalid_request_error
    │   ├── ContextLengthExceededError   400 code=context_length_exceeded
    │   ├── ContentFilterError           400 code=content_filter (input moderation blocked it)
    │   ├── RequestTimeoutError          408 code=request_timeout (the request arrived too slowly)
    │   ├── BodyTooLargeError            413 code=body_too_large
    │   └── HeadersTooLargeError         431 code=headers_too_large
    ├── AuthenticationError          401 authentication_error
    ├── PermissionDeniedError        403 permission_denied
    ├── NotFoundError                404 not_found_error (admin resources)
    ├── ModelNotFoundError           404 code=model_not_found
    ├── ConflictError                409 code=conflict
    │   └── IdempotencyInProgressError   409 code=idempotency_key_in_use, retry-after
    ├── IdempotencyMismatchError     422 code=idempotency_key_reused (same key, other body)
    ├── RateLimitError               429 code=rate_limit_exceeded, retry-after
    │   └── QuotaExhaustedError          429 code=insufficient_quota, x-should-retry: false
    │       └── BudgetExhaustedError         the tenant's monthly budget is spent
    ├── OverloadedError              503 code=overloaded, retry-after (admission shed the request)
    ├── NoHealthyWorkerError         503 code=no_healthy_worker, retry-after
    ├── ClientDisconnectedError      499 (client left while queued: for logs and counters)
    ├── StoreUnavailableError        503 code=store_unavailable (quota store down, fail-closed)
    ├── ModerationUnavailableError   503 code=moderation_unavailable (a fail-closed provider failed)
    ├── DeadlineExceededError        504 code=deadline_exceeded, x-should-retry: false
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
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.extra_headers = extra_headers or {}

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
        headers = dict(self.extra_headers)
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


class ContentFilterError(InvalidRequestError):
    """Input moderation blocked the request; nothing was generated or charged."""

    default_code = "content_filter"


class RequestTimeoutError(InvalidRequestError):
    """The request's head or body did not arrive within the gateway's time limit (a client
    sending it byte by byte); the connection is closed."""

    status_code = 408
    default_code = "request_timeout"


class BodyTooLargeError(InvalidRequestError):
    """The request body is larger than the gateway accepts."""

    status_code = 413
    default_code = "body_too_large"


class HeadersTooLargeError(InvalidRequestError):
    """The request line and headers are larger than the gateway accepts."""

    status_code = 431
    default_code = "headers_too_large"


class AuthenticationError(TandemError):
    """Missing, unknown or revoked API key."""

    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(TandemError):
    """A valid credential used where it has no rights (a tenant key on the admin API)."""

    status_code = 403
    error_type = "permission_denied"
    default_code = "permission_denied"


class NotFoundError(TandemError):
    """An admin resource (tenant, key) that does not exist."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(TandemError):
    """The requested model is not served by this gateway."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class ConflictError(TandemError):
    """The request conflicts with the current state (a name already taken)."""

    status_code = 409
    error_type = "invalid_request_error"
    default_code = "conflict"


class IdempotencyInProgressError(ConflictError):
    """A request with the same ``Idempotency-Key`` is still running; retry after it ends."""

    default_code = "idempotency_key_in_use"


class IdempotencyMismatchError(TandemError):
    """The ``Idempotency-Key`` was already used with a different request body."""

    status_code = 422
    error_type = "invalid_request_error"
    default_code = "idempotency_key_reused"


class RateLimitError(TandemError):
    """A tenant's RPM, TPM or concurrency limit is reached now; retrying after
    ``retry_after_s`` will succeed if nothing else is spent meanwhile."""

    status_code = 429
    error_type = "requests"
    default_code = "rate_limit_exceeded"


class QuotaExhaustedError(RateLimitError):
    """The wait is longer than a client should sit through (over 120 s), or the request can
    never fit the plan: the SDK is told not to retry."""

    error_type = "insufficient_quota"
    default_code = "insufficient_quota"


class BudgetExhaustedError(QuotaExhaustedError):
    """The tenant's monthly spend reached its budget: nothing is admitted until the month
    turns or an administrator raises it."""


class OverloadedError(TandemError):
    """Admission shed the request: the queue is full or its deadline cannot be met."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "overloaded"


class NoHealthyWorkerError(TandemError):
    """No worker of a pool can take the request right now; retrying later may succeed."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "no_healthy_worker"


class ClientDisconnectedError(TandemError):
    """The client hung up while its request waited for admission. Nobody reads this answer;
    it exists for the logs and the rejection counter."""

    status_code = 499  # nginx's "client closed request"
    error_type = "client_closed_request"
    default_code = "client_closed_request"


class EngineError(TandemError):
    """A worker failed, was unreachable, or answered something that is not vLLM's protocol."""

    status_code = 502
    error_type = "api_error"
    default_code = "engine_error"


class EngineTimeoutError(EngineError):
    """A worker did not answer within the request's time budget."""

    status_code = 504
    default_code = "engine_timeout"


class StoreUnavailableError(TandemError):
    """The quota store cannot be reached and the policy is fail-closed."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "store_unavailable"


class ModerationUnavailableError(TandemError):
    """A moderation provider the policy requires failed and its failure policy is closed."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "moderation_unavailable"


class DeadlineExceededError(TandemError):
    """The request's deadline passed (in the queue, prefill or decode). Retrying the same
    request with the same deadline would most likely time out again, so the SDK is told not to."""

    status_code = 504
    error_type = "timeout_error"
    default_code = "deadline_exceeded"

    def __init__(self, message: str) -> None:
        super().__init__(message, should_retry=False)
