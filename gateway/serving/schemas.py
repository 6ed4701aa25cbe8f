"""Validation of client requests at the HTTP edge.

The models check what the gateway relies on and what a client most often gets wrong; fields
they do not name pass through to the engine untouched (``extra="allow"``), so a client can use
any vLLM sampling option. The gateway forwards the client's own JSON, not a re-dump of these
models, so defaults here never change what the engine is asked.

They also hold the limits of single fields (OpenAI's where it has them: ``n``, ``stop``,
``messages``), the nesting depth of the whole body (``gateway/limits.py``), and JSON types as
sent. Their JSON schema is the OpenAPI document's request body (``gateway/assembly/openapi.py``),
so what a validator checks beyond a field's type is written into the schema too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway.limits import check_json_depth

MAX_MESSAGES = 2048
"""Messages in one chat request (OpenAI's own limit)."""
MAX_STOP_SEQUENCES = 4
"""Stop sequences in one request (OpenAI's own limit)."""
MAX_N = 128
"""Choices in one request (OpenAI's own limit)."""
MAX_LOGIT_BIASES = 1024
"""Tokens one ``logit_bias`` may weigh (we choose: enough to ban a long word list)."""


def _a_json_number(value: Any) -> Any:
    # JSON Schema's integer includes 2.0, so a lax int is right, but it also takes true for 1
    # and "2" for 2, which no client means.
    if isinstance(value, bool | str | bytes):
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    return value


_JSON_NUMBER = BeforeValidator(_a_json_number)
# Integers as JSON has them: 2 or 2.0, never true or "2". The bounds sit in the same Field as
# strict=False, before the validator: pydantic drops bounds given after one.
JsonInt = Annotated[int, Field(strict=False), _JSON_NUMBER]
PositiveInt = Annotated[int, Field(strict=False, ge=1), _JSON_NUMBER]
StopField = str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]
"""A token id as ``logit_bias`` keys carry it: a decimal string."""
LogitBias = Annotated[
    dict[TokenId, Annotated[float, Field(ge=-100, le=100)]],
    # Keys that are not token ids are refused, and the JSON schema says so too.
    Field(max_length=MAX_LOGIT_BIASES, json_schema_extra={"additionalProperties": False}),
]


class _Lenient(BaseModel):
    # Strict: JSON types are taken as sent (no "yes" for true, no 1 for "1"; integers are
    # ``JsonInt``), so a request means what its JSON says to the gateway and to the engine.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


def _stream_options_need_stream_schema(schema: dict[str, Any]) -> None:
    # What ``_stream_options_need_stream`` checks, in the JSON schema too (the OpenAPI document).
    schema["if"] = {
        "properties": {"stream_options": {"type": "object"}},
        "required": ["stream_options"],
    }
    schema["then"] = {"properties": {"stream": {"const": True}}, "required": ["stream"]}


def _non_empty_lists_schema(schema: dict[str, Any]) -> None:
    # What ``_prompt_not_empty`` checks, in the JSON schema too.
    for branch in schema.get("anyOf", ()):
        if branch.get("type") == "array":
            branch["minItems"] = 1


class _SamplingFields(_Lenient):
    model_config = ConfigDict(
        extra="allow", strict=True, json_schema_extra=_stream_options_need_stream_schema
    )

    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, Field(strict=False, ge=1, le=MAX_N), _JSON_NUMBER] | None = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StopField = None
    user: str | None = None
    logit_bias: LogitBias | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any) -> Any:
        # Before the fields: the body is forwarded as sent, and its encoder has a depth limit.
        check_json_depth(data)
        return data

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # ``stream`` is declared first, so it is validated by now.
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: PositiveInt | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: Annotated[
        str | list[str] | list[JsonInt] | list[list[JsonInt]],
        Field(json_schema_extra=_non_empty_lists_schema),
    ]
    logprobs: Annotated[int, Field(strict=False, ge=0, le=5), _JSON_NUMBER] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value
