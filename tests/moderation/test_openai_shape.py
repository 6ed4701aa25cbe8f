"""``/v1/moderations``: request parsing errors and OpenAI's exact response shape."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import InvalidRequestError
from core.moderation import OPENAI_CATEGORIES, Category
from moderation.hits import Hit, result_of
from moderation.openai_shape import moderation_response, parse_moderation_input

KEYS = [
    "hate", "hate/threatening", "harassment", "harassment/threatening", "illicit",
    "illicit/violent", "self-harm", "self-harm/intent", "self-harm/instructions", "sexual",
    "sexual/minors", "violence", "violence/graphic",
]  # fmt: skip


def test_every_map_has_exactly_the_13_openai_keys() -> None:
    results = [
        result_of([Hit(Category.VIOLENCE, "rules", 0, 4), Hit(Category.PII, "rules", 5, 9)]),
        result_of([]),
    ]
    body = moderation_response(results, "tandem-moderation", "abc")
    assert body["id"] == "modr-abc"
    assert body["model"] == "tandem-moderation"
    assert len(body["results"]) == 2
    for result in body["results"]:
        assert set(result) == {
            "flagged",
            "categories",
            "category_scores",
            "category_applied_input_types",
        }
        for key in ("categories", "category_scores", "category_applied_input_types"):
            assert list(result[key]) == KEYS, key
    first = body["results"][0]
    assert first["flagged"] is True
    assert first["categories"]["violence"] is True
    assert first["category_scores"]["violence"] == 1.0
    assert first["category_scores"]["hate"] == 0.0
    assert isinstance(first["category_scores"]["hate"], float)


def test_pii_alone_does_not_flag() -> None:
    body = moderation_response([result_of([Hit(Category.PII, "rules", 0, 4)])], "m", "x")
    assert body["results"][0]["flagged"] is False
    assert "pii" not in body["results"][0]["categories"]


def test_applied_input_types_follow_what_was_checked() -> None:
    result = result_of([], frozenset({Category.VIOLENCE, Category.PII}))
    types = moderation_response([result], "m", "x")["results"][0]["category_applied_input_types"]
    assert types["violence"] == ["text"]
    assert types["hate"] == []
    assert [k for k, v in types.items() if v] == ["violence"]
    assert tuple(c.value for c in OPENAI_CATEGORIES) == tuple(KEYS)


@pytest.mark.parametrize(
    ("body", "texts"),
    [
        ({"input": "hello"}, ["hello"]),
        ({"input": ["a", "b"], "model": "omni-moderation-latest"}, ["a", "b"]),
        ({"input": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, ["a\nb"]),
    ],
)
def test_inputs(body: dict[str, Any], texts: list[str]) -> None:
    assert parse_moderation_input(body) == texts


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "input is required"),
        ({"input": ""}, "input", "input is required"),
        ({"input": []}, "input", "input is required"),
        ({"input": 3}, "input", "must be a string or a list"),
        ({"input": ["a", 1]}, "input", "not a mix"),
        (
            {"input": [{"type": "image_url", "image_url": {"url": "https://x/i.png"}}]},
            "input",
            "image",
        ),
        ({"input": [{"type": "text"}]}, "input", r"input\[0\]\.text must be a string"),
        ({"input": [{"type": "audio"}]}, "input", "must be 'text'"),
        ({"input": "x", "model": 5}, "model", "model must be a string"),
    ],
)
def test_input_errors(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as caught:
        parse_moderation_input(body)
    assert caught.value.param == param
    assert caught.value.status_code == 400
