"""Backlog: the requests of each version waiting for their first token, and their prompt
tokens (admission's estimate), counted while a block runs."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from core.messages import Endpoint
from core.models import ServedModel
from core.prompt import TokenEstimate
from core.request import Request
from traffic.backlog import Backlog, Waiting

V1 = ServedModel("m", 256, 0, version="m@11111111")
V2 = ServedModel("m", 256, 0, version="m@22222222")


def request(model: ServedModel = V1, prompt_tokens: int | None = None) -> Request:
    """A request to ``model``; with ``prompt_tokens``, admission's estimate recorded on it."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    made = Request.receive("r", Endpoint.CHAT, model, body)
    if prompt_tokens is not None:
        made.record_estimate(TokenEstimate(prompt_tokens, max_output_tokens=16, num_choices=1))
    return made


def test_counts_requests_and_sums_their_prompt_tokens_while_they_wait() -> None:
    backlog = Backlog()
    assert backlog.of(V1.version_name) == Waiting(0, 0)
    with backlog.waiting(request(prompt_tokens=100)):
        assert backlog.of(V1.version_name) == Waiting(1, 100)
        with backlog.waiting(request(prompt_tokens=250)):
            assert backlog.of(V1.version_name) == Waiting(2, 350)
        assert backlog.of(V1.version_name) == Waiting(1, 100)
    assert backlog.of(V1.version_name) == Waiting(0, 0)


def test_a_request_without_an_estimate_counts_with_no_tokens() -> None:
    backlog = Backlog()
    unestimated = request()
    with backlog.waiting(unestimated), backlog.waiting(request(prompt_tokens=40)):
        assert backlog.of(V1.version_name) == Waiting(2, 40)
        # Its estimate, recorded while it waits, counts from then on.
        unestimated.record_estimate(TokenEstimate(7, max_output_tokens=16, num_choices=1))
        assert backlog.of(V1.version_name) == Waiting(2, 47)


def test_a_request_leaving_by_an_exception_is_no_longer_counted() -> None:
    backlog = Backlog()
    with backlog.waiting(request(prompt_tokens=5)):
        with pytest.raises(TimeoutError), backlog.waiting(request(prompt_tokens=30)):
            raise TimeoutError("its deadline passed in the queue")
        assert backlog.of(V1.version_name) == Waiting(1, 5)
    assert backlog.of(V1.version_name) == Waiting(0, 0)


def test_versions_are_counted_apart() -> None:
    backlog = Backlog()
    with ExitStack() as stack:
        for model, tokens in ((V1, 10), (V2, 20), (V2, 30)):
            stack.enter_context(backlog.waiting(request(model, tokens)))
        assert backlog.of(V1.version_name) == Waiting(1, 10)
        assert backlog.of(V2.version_name) == Waiting(2, 50)
        assert backlog.of("m") == Waiting(0, 0)  # the alias is not a version
    assert backlog.of(V2.version_name) == Waiting(0, 0)


def test_an_unregistered_model_is_counted_under_its_name() -> None:
    backlog = Backlog()
    plain = ServedModel("plain", 256, 0)  # no version: responses name it by its alias
    with backlog.waiting(request(plain, 12)):
        assert backlog.of("plain") == Waiting(1, 12)


def test_requests_alike_in_every_field_are_counted_apart() -> None:
    backlog = Backlog()
    first, second = request(prompt_tokens=8), request(prompt_tokens=8)
    with backlog.waiting(first), backlog.waiting(second):  # same id, body and estimate
        assert backlog.of(V1.version_name) == Waiting(2, 16)
