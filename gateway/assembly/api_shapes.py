"""What the gateway answers (and the one body it reads without a model), as the OpenAPI
document declares it (``gateway/assembly/openapi.py``).

Documentation only: the routes build their bodies themselves (the OpenAI routes relay the
engine's JSON, the admin routes write dicts), and nothing here runs on a request. The fuzz tests
(``tests/fuzz``) check every answer against these shapes, so a route that drifts from them fails
there. The admin API's shapes forbid fields they do not name; OpenAI's allow the engine's extras.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from admission.plans import PriorityBand
from core.moderation import OPENAI_CATEGORIES


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Strict):
    message: str
    type: str
    param: str | None
    code: str | None


class Error(_Strict):
    """OpenAI's error body: every error the gateway answers, framework ones included."""

    error: ErrorDetail


# Tenants and keys (gateway/admin/tenants.py, admission/plan_codec.py).


class PlanShape(_Strict):
    tpm: int | None
    rpm: int | None
    max_concurrent: int | None
    max_prompt_tokens: int | None
    max_output_tokens: int | None
    weight: float
    band: PriorityBand
    moderation: dict[str, Any] | None


class TenantShape(_Strict):
    tenant_id: str
    name: str
    plan: PlanShape
    created_at: float
    updated_at: float


class TenantList(_Strict):
    object: Literal["list"]
    data: list[TenantShape]


class TenantDeleted(_Strict):
    id: str
    object: Literal["tenant"]
    deleted: Literal[True]


class KeyShape(_Strict):
    """A key as listed: never its secret, nor its hash."""

    key_id: str
    tenant_id: str
    name: str
    display_prefix: str
    created_at: float
    revoked_at: float | None
    last_used_at: float | None


class IssuedKeyShape(KeyShape):
    """A key as issued: its plaintext, in this answer only."""

    key: str


class KeyList(_Strict):
    object: Literal["list"]
    data: list[KeyShape]


class BucketShape(_Strict):
    limit_per_minute: int | None
    remaining: int | None
    reset_s: float


class TenantUsageShape(_Strict):
    tenant_id: str
    name: str
    plan: PlanShape
    requests: BucketShape
    tokens: BucketShape
    concurrent: int
    queued_here: int
    fairness_counter_here: float | None


# The OpenAI routes (gateway/serving/routes.py): the engine's bodies, with the gateway's id,
# created and model.


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(_Open):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    finish_reason: str | None


class ChatCompletionShape(_Open):
    id: str = Field(pattern=r"^chatcmpl-")
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Open):
    index: int
    text: str
    finish_reason: str | None


class CompletionShape(_Open):
    id: str = Field(pattern=r"^cmpl-")
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatDelta(_Open):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Open):
    index: int
    delta: ChatDelta
    finish_reason: str | None


class ChatCompletionChunkShape(_Open):
    """One event of a chat stream (the last one, with ``include_usage``, has no choices)."""

    id: str = Field(pattern=r"^chatcmpl-")
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunkChoice(_Open):
    index: int
    text: str
    finish_reason: str | None


class CompletionChunkShape(_Open):
    """One event of a completions stream."""

    id: str = Field(pattern=r"^cmpl-")
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ModerationRequest(_Open):
    """``POST /v1/moderations``: one text, several, or one input of text parts (what
    ``moderation/openai_shape.py`` accepts; the route reads its own JSON)."""

    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | (Annotated[list[TextPart], Field(min_length=1)])
    )
    model: str | None = None


class ModelShape(_Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    default_max_tokens: int | None
    version_of: str | None = None


class ModelList(_Strict):
    object: Literal["list"]
    data: list[ModelShape]


_CATEGORY_KEYS = sorted(category.value for category in OPENAI_CATEGORIES)


def _exactly_the_categories(schema: dict[str, Any]) -> None:
    # OpenAI's 13 categories, no more, no fewer (docs/WIRE.md, section 5).
    schema["required"] = _CATEGORY_KEYS
    schema["propertyNames"] = {"enum": _CATEGORY_KEYS}


class ModerationResult(_Strict):
    flagged: bool
    categories: dict[str, bool] = Field(json_schema_extra=_exactly_the_categories)
    category_scores: dict[str, float] = Field(json_schema_extra=_exactly_the_categories)
    category_applied_input_types: dict[str, list[Literal["text"]]] = Field(
        json_schema_extra=_exactly_the_categories
    )


class ModerationShape(_Strict):
    id: str
    model: str
    results: list[ModerationResult]


class Health(_Strict):
    status: Literal["ok"]


class Readiness(_Strict):
    status: Literal["ready", "not_ready"]
    versions: dict[str, bool]
    workers: list[dict[str, Any]]
