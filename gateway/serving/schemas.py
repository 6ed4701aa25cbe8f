"""Validation of client requests at the HTTP edge.

The models check what the gateway relies on and what a client most often gets wrong; fields
they do not name pass through to the engine untouched (``extra="allow"``), so a client can use
any vLLM sampling option. The gateway forwards the client's own JSON, not a re-dump of these
models, so defaults here never change what the engine is asked.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.limits import check_json_depth

PositiveInt = Annotated[int, Field(ge=1)]
StopField = str | Annotated[list[str], Field(max_length=4)] | None


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class _SamplingFields(_Lenient):
    model: Annotated[str, Field(min_length=1)]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: StopField = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any) -> Any:
        # Before the fields: the body is forwarded as sent, and its encoder has a depth limit.
        check_json_depth(data)
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None

    @model_validator(mode="after")
    def _prompt_not_empty(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self
