"""The gateway's quick check of a request body never lets through one its pydantic model
refuses (hypothesis; ``gateway.serving.schemas.validate_request``).

Bodies are drawn around the models' edges: every declared field absent, plainly valid, or any
JSON value (bools where numbers go, ``2.0`` for 2, NaN, huge integers, lists of the wrong
items, unknown roles, empty strings). Whenever the quick check passes a body, the model must
accept it; what the quick check leaves to the model is the model's to decide, so nothing else
is asserted.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.serving.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    plainly_valid,
)
from tests.properties.profiles import examples

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 200),
    st.integers(2**62, 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from((0.0, 1.0, 2.0, 0.5, 2.5, -0.0)),
    st.text(max_size=3),
)
_any_json = st.one_of(
    _scalars,
    st.lists(_scalars, max_size=6),
    st.dictionaries(st.text(max_size=3), _scalars, max_size=3),
)
_roles = st.sampled_from(("system", "developer", "user", "assistant", "tool", "function"))
_message = st.fixed_dictionaries(
    {"role": _roles},
    optional={
        "content": st.one_of(
            st.none(),
            st.text(max_size=5),
            st.lists(st.dictionaries(st.text(max_size=4), _scalars, max_size=2), max_size=2),
        ),
        "name": st.text(max_size=3),
    },
)
_odd_message = st.one_of(
    st.fixed_dictionaries({"role": _any_json}, optional={"content": _any_json}),
    st.fixed_dictionaries({}, optional={"content": st.text(max_size=3)}),
    _any_json,
)
_SAMPLING = {
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "max_tokens": st.integers(1, 4096),
    "n": st.integers(1, 128),
    "temperature": st.floats(0, 2) | st.integers(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True) | st.just(1),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
    "user": st.text(max_size=3),
    "logit_bias": st.dictionaries(st.sampled_from(("1", "22")), st.floats(-100, 100)),
    "top_k": _any_json,
}
_SAMPLING_EDGES = {
    "model": st.sampled_from(("", 1, None, ["m"])),
    "stream": st.sampled_from((1, 0, 1.0, "true")),
    "stream_options": st.sampled_from(({"include_usage": 1}, {"include_usage": "yes"}, [])),
    "max_tokens": st.sampled_from((0, -1, 1.0, 2.5, True, "8")),
    "n": st.sampled_from((0, 129, 1.0, True, 2**70)),
    "temperature": st.sampled_from((-0.1, 2.0001, float("nan"), float("inf"), True, "1")),
    "top_p": st.sampled_from((0, 0.0, -0.0, 1.0001, float("nan"), False)),
    "stop": st.sampled_from((["a"] * 5, [1], ["a", None], {"a": "b"})),
    "user": st.sampled_from((1, [], True)),
    "logit_bias": st.sampled_from(({"x": 1.0}, {"1": 101.0}, [])),
}
_CHAT_REQUIRED = {
    "model": st.text(min_size=1, max_size=4),
    "messages": st.lists(_message, min_size=1, max_size=4),
}
_CHAT_OPTIONAL = {**_SAMPLING, "max_completion_tokens": st.integers(1, 4096)}
_CHAT_EDGES = {
    **_SAMPLING_EDGES,
    "messages": st.lists(st.one_of(_message, _odd_message), max_size=3),
    "max_completion_tokens": st.sampled_from((0, 1.0, False)),
}
_COMPLETION_REQUIRED = {"model": st.text(min_size=1, max_size=4), "prompt": st.text(max_size=5)}
_COMPLETION_OPTIONAL = {**_SAMPLING, "logprobs": st.integers(0, 5)}
_COMPLETION_EDGES = {
    **_SAMPLING_EDGES,
    "prompt": st.sampled_from(([], [1, 2], ["a"], [[1]], None, 1)),
    "logprobs": st.sampled_from((-1, 6, 1.0, True)),
}


@st.composite
def _bodies(
    draw: st.DrawFn,
    required: dict[str, st.SearchStrategy[Any]],
    optional: dict[str, st.SearchStrategy[Any]],
    edges: dict[str, st.SearchStrategy[Any]],
) -> dict[str, Any]:
    """A valid body (its required fields, some optional ones), then up to two fields dropped,
    set to one of their edge values, or set to any JSON value."""
    body = {name: draw(strategy) for name, strategy in required.items()}
    body.update(
        {name: draw(strategy) for name, strategy in optional.items() if draw(st.booleans())}
    )
    if "stream_options" in body:
        body["stream"] = True
    names = sorted({*required, *optional})
    for name in draw(st.lists(st.sampled_from(names), max_size=2, unique=True)):
        how = draw(st.sampled_from(("drop", "edge", "any")))
        if how == "drop":
            body.pop(name, None)
        elif how == "edge" and name in edges:
            body[name] = draw(edges[name])
        else:
            body[name] = draw(_any_json)
    return body


_chat = _bodies(_CHAT_REQUIRED, _CHAT_OPTIONAL, _CHAT_EDGES)
_completion = _bodies(_COMPLETION_REQUIRED, _COMPLETION_OPTIONAL, _COMPLETION_EDGES)


def _model_accepts(schema: type[ChatCompletionRequest | CompletionRequest], body: Any) -> bool:
    try:
        schema.model_validate(body)
    except ValidationError:
        return False
    return True


@settings(max_examples=examples(1500))
@given(body=_chat)
def test_a_chat_body_the_quick_check_passes_is_one_the_model_accepts(body: dict) -> None:
    if plainly_valid(ChatCompletionRequest, body):
        assert _model_accepts(ChatCompletionRequest, body), body


@settings(max_examples=examples(1000))
@given(body=_completion)
def test_a_completion_body_the_quick_check_passes_is_one_the_model_accepts(body: dict) -> None:
    if plainly_valid(CompletionRequest, body):
        assert _model_accepts(CompletionRequest, body), body
