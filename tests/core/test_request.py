from __future__ import annotations

import pytest

from core.messages import Usage
from core.request import PhaseError, Request, RequestPhase


def make() -> Request:
    return Request(request_id="r1", model="m", stream=True)


def test_phases_move_forward_and_may_skip() -> None:
    request = make()
    request.advance(RequestPhase.PREFILLING)
    request.advance(RequestPhase.DECODING)  # KV_TRANSFERRING skipped is allowed
    request.finish("stop", Usage(3, 2))
    assert request.phase is RequestPhase.FINISHED
    assert request.usage is not None and request.usage.total_tokens == 5
    assert request.e2e_s is not None


def test_going_back_is_refused() -> None:
    request = make()
    request.advance(RequestPhase.DECODING)
    with pytest.raises(PhaseError, match="cannot go from DECODING to PREFILLING"):
        request.advance(RequestPhase.PREFILLING)


def test_terminal_phases_only_through_their_methods() -> None:
    with pytest.raises(PhaseError, match="use finish/fail/abort"):
        make().advance(RequestPhase.FINISHED)


@pytest.mark.parametrize("end", ["finish", "fail", "abort"])
def test_a_request_ends_exactly_once(end: str) -> None:
    request = make()
    {
        "finish": lambda: request.finish("stop", None),
        "fail": lambda: request.fail("x"),
        "abort": request.abort,
    }[end]()
    assert request.phase.is_terminal
    with pytest.raises(PhaseError, match="already ended"):
        request.abort()


def test_usage_reads_openai_shape_with_cached_tokens() -> None:
    usage = Usage.from_openai(
        {"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 6}}
    )
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (10, 4, 6)
    assert Usage.from_openai({"prompt_tokens": 1, "prompt_tokens_details": None}).cached_tokens == 0
