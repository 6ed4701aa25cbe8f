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

from typing import Annotated, Any, Literal, get_args

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


def validate_request(schema: type[_SamplingFields], body: dict[str, Any]) -> None:
    """``schema.model_validate(body)``: raises ``ValidationError`` (or the depth limit's 400)
    for a body the model refuses. The usual request (a model, plain messages or a text prompt,
    the common sampling options as plain JSON values) is checked here in plain Python instead:
    pydantic's validation took 0.07 ms at one stream, its compiled code cold in the CPU's
    caches between requests, against 0.016 here. Anything else, and every refusal, is
    pydantic's to decide and word."""
    check_json_depth(body)
    if not plainly_valid(schema, body):
        schema.model_validate(body)


# The fields ``plainly_valid`` checks, per model. A field added to a model must be added
# here and checked there too (tests/gateway/test_units.py holds these equal to the models').
_SAMPLING_QUICK = frozenset(
    ("model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p", "stop",
     "user", "logit_bias")
)  # fmt: skip
QUICK_FIELDS: dict[type[_SamplingFields], frozenset[str]] = {
    ChatCompletionRequest: _SAMPLING_QUICK | {"messages", "max_completion_tokens"},
    CompletionRequest: _SAMPLING_QUICK | {"prompt", "logprobs"},
}
_ROLES = frozenset(get_args(ChatMessage.model_fields["role"].annotation))


def plainly_valid(schema: type[_SamplingFields], body: dict[str, Any]) -> bool:
    """True only for a body the model accepts; False means "ask the model", not "invalid"
    (tests/properties/test_request_validation_properties.py checks it against pydantic over
    generated bodies). Integers must be ``int`` and numbers ``int`` or ``float`` here, as
    strict JSON types are; the lax forms the model also takes (``2.0`` for 2) go to it."""
    get = body.get
    model = get("model")
    if type(model) is not str or not model:
        return False
    stream = get("stream")
    if not _bool_or_none(stream) or get("logit_bias") is not None:
        return False
    options = get("stream_options")
    if options is not None and not (
        type(options) is dict and stream is True and _bool_or_none(options.get("include_usage"))
    ):
        return False
    if not (
        _int_in(get("max_tokens"), 1, None)
        and _int_in(get("n"), 1, MAX_N)
        and _number_in(get("temperature"), 0.0, 2.0, open_low=False)
        and _number_in(get("top_p"), 0.0, 1.0, open_low=True)
    ):
        return False
    stop, user = get("stop"), get("user")
    if not (stop is None or type(stop) is str or _short_list_of_str(stop)):
        return False
    if not (user is None or type(user) is str):
        return False
    if schema is ChatCompletionRequest:
        return _int_in(get("max_completion_tokens"), 1, None) and _plain_messages(get("messages"))
    if schema is CompletionRequest:
        return type(get("prompt")) is str and _int_in(get("logprobs"), 0, 5)
    return False


def _bool_or_none(value: Any) -> bool:
    # By identity: ``1 in (True, False)`` holds, and the model takes no 1 for true.
    return value is None or value is True or value is False


def _int_in(value: Any, low: int, high: int | None) -> bool:
    """Absent (None), or an ``int`` (not a bool) within [low, high]."""
    if value is None:
        return True
    return type(value) is int and low <= value and (high is None or value <= high)


def _number_in(value: Any, low: float, high: float, *, open_low: bool) -> bool:
    """Absent (None), or an ``int`` or ``float`` (not a bool, not NaN) within the bounds."""
    if value is None:
        return True
    if type(value) is not float and type(value) is not int:
        return False
    return (low < value if open_low else low <= value) and value <= high


def _short_list_of_str(value: Any) -> bool:
    return (
        type(value) is list
        and len(value) <= MAX_STOP_SEQUENCES
        and all(type(item) is str for item in value)
    )


def _plain_messages(messages: Any) -> bool:
    """1 to ``MAX_MESSAGES`` messages, each an object with a known role and a text content,
    a list of content parts (objects), or none."""
    if type(messages) is not list or not 0 < len(messages) <= MAX_MESSAGES:
        return False
    for message in messages:
        if type(message) is not dict:
            return False
        role = message.get("role")
        if type(role) is not str or role not in _ROLES:
            return False
        content = message.get("content")
        if content is None or type(content) is str:
            continue
        if type(content) is not list or not all(type(part) is dict for part in content):
            return False
    return True
