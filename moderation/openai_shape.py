"""``POST /v1/moderations`` in OpenAI's shapes: parse the request's ``input``, build the
response.

Every map in a result has exactly the 13 keys of
:data:`core.moderation.OPENAI_CATEGORIES`; PII hits are Tandem's own category, so they are
left out (and do not set ``flagged``): clients written for OpenAI see OpenAI's schema.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.errors import InvalidRequestError
from core.moderation import OPENAI_CATEGORIES
from moderation.hits import TextResult


def parse_moderation_input(body: Mapping[str, Any]) -> list[str]:
    """The texts to classify, one result each: a string, a list of strings, or one
    multi-modal input (a list of ``text`` parts, joined with newlines, as OpenAI classifies
    such a list as a single input). Images are refused: no provider here can see them."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model must be a string", param="model")
    raw = body.get("input")
    if raw is None or raw == "" or raw == []:
        raise InvalidRequestError("input is required: a string or a list of strings", param="input")
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list):
        raise InvalidRequestError(
            f"input must be a string or a list, got {type(raw).__name__}", param="input"
        )
    if all(isinstance(item, str) for item in raw):
        return list(raw)
    if all(isinstance(item, Mapping) for item in raw):
        return ["\n".join(_part_text(i, part) for i, part in enumerate(raw))]
    raise InvalidRequestError(
        "input must be a list of strings or a list of content parts, not a mix", param="input"
    )


def _part_text(index: int, part: Mapping[str, Any]) -> str:
    kind = part.get("type")
    if kind == "image_url":
        raise InvalidRequestError(
            f"input[{index}] is an image; this server moderates text only: send text parts",
            param="input",
        )
    if kind != "text":
        raise InvalidRequestError(
            f"input[{index}].type must be 'text', got {kind!r}", param="input"
        )
    text = part.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"input[{index}].text must be a string", param="input")
    return text


def moderation_response(
    results: Sequence[TextResult], model: str, request_id: str
) -> dict[str, Any]:
    """OpenAI's moderation response body for one result per input."""
    return {
        "id": f"modr-{request_id}",
        "model": model,
        "results": [_result(result) for result in results],
    }


def _result(result: TextResult) -> dict[str, Any]:
    hit = result.categories
    categories = {c.value: c in hit for c in OPENAI_CATEGORIES}
    return {
        "flagged": any(categories.values()),
        "categories": categories,
        "category_scores": {c.value: float(result.scores.get(c, 0.0)) for c in OPENAI_CATEGORIES},
        "category_applied_input_types": {
            c.value: ["text"] if c in result.checked else [] for c in OPENAI_CATEGORIES
        },
    }
