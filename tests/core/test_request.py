from __future__ import annotations

import pytest

from core.messages import Endpoint, ServingPath, Usage
from core.models import ServedModel
from core.prompt import TokenEstimate
from core.request import PhaseError, Request, RequestPhase

MODEL = ServedModel("m", 256, 0, kv_block_bytes=1000)


def make() -> Request:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    return Request.receive("r1", Endpoint.CHAT, MODEL, body)


def admitted() -> Request:
    request = make()
    request.record_estimate(TokenEstimate(prompt_tokens=8, max_output_tokens=4, num_choices=1))
    request.admit(queue_wait_s=0.0)
    return request


def make_decoding() -> Request:
    request = admitted()
    request.advance(RequestPhase.DECODING)
    return request


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


def test_a_decoding_stream_lets_go_of_its_prompt_and_keeps_the_rest() -> None:
    request = make_decoding()
    request.let_go_of_prompt()
    assert request.body == {"model": "m", "stream": True}
    assert request.prompt.raw is None and request.prompt.texts == ()
    assert request.prompt.num_messages == 1 and request.prompt.param == "messages"


def test_a_prompt_kept_for_the_request_log_stays() -> None:
    request = admitted()
    request.keep_prompt()
    request.advance(RequestPhase.DECODING)
    request.let_go_of_prompt()
    assert request.body["messages"] == [{"role": "user", "content": "hi"}]
    assert request.prompt.texts == ("hi",)
    with pytest.raises(PhaseError, match="keep_prompt in phase DECODING"):
        make_decoding().keep_prompt()


def test_only_a_decoding_stream_lets_go_of_its_prompt() -> None:
    # Before it decodes, a failed leg may still be re-run with the body; an answer that is
    # not streamed re-runs it even while it decodes.
    with pytest.raises(PhaseError, match="in phase ADMITTED"):
        admitted().let_go_of_prompt()
    answer = Request.receive("r2", Endpoint.CHAT, MODEL, {"model": "m", "messages": []})
    answer.advance(RequestPhase.DECODING)
    with pytest.raises(PhaseError, match="not a stream"):
        answer.let_go_of_prompt()
    assert answer.body["messages"] == []


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


def test_receive_reads_the_body_once() -> None:
    body = {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    request = Request.receive("r1", Endpoint.CHAT, MODEL, body)
    assert (request.stream, request.include_usage) == (True, True)
    assert request.prompt.texts == ("hi",)


def test_admission_needs_an_estimate_and_happens_once() -> None:
    request = make()
    with pytest.raises(PhaseError, match="without a token estimate"):
        request.admit(queue_wait_s=0.0)
    request = admitted()
    with pytest.raises(PhaseError, match="cannot go from ADMITTED to ADMITTED"):
        request.admit(queue_wait_s=0.0)
    with pytest.raises(PhaseError, match="record_estimate in phase ADMITTED"):
        request.record_estimate(TokenEstimate(1, 1, 1))


def test_the_body_is_fixed_once_admitted() -> None:
    request = make()
    request.redact({"model": "m", "messages": [{"role": "user", "content": "[redacted]"}]})
    assert request.prompt.texts == ("[redacted]",)
    request.cap_output(12)
    assert request.body["max_tokens"] == 12
    request.record_estimate(TokenEstimate(1, 12, 1))
    request.admit(queue_wait_s=0.0)
    with pytest.raises(PhaseError, match="redact in phase ADMITTED"):
        request.redact({"model": "m", "messages": []})
    with pytest.raises(PhaseError, match="cap_output in phase ADMITTED"):
        request.cap_output(3)


def test_a_request_is_routed_once_after_admission() -> None:
    with pytest.raises(PhaseError, match="routed in phase RECEIVED"):
        make().route(ServingPath.COLOCATED, "short_prompt", "decode-0")
    request = admitted()
    with pytest.raises(PhaseError, match="with prefill worker None"):
        request.route(ServingPath.DISAGGREGATED, "long_prompt", "decode-0")
    request.route(ServingPath.DISAGGREGATED, "long_prompt", "decode-0", "prefill-0")
    with pytest.raises(PhaseError, match="routed in phase ADMITTED"):
        request.route(ServingPath.COLOCATED, "short_prompt", "decode-0")


def test_legs_and_hand_off_move_the_phase_and_mark_the_engine_ran() -> None:
    request = admitted()
    with pytest.raises(PhaseError, match="a leg sent before routing"):
        request.leg_sent(decode=True)
    request.route(ServingPath.DISAGGREGATED, "long_prompt", "decode-0", "prefill-0")
    assert not request.engine_ran
    with pytest.raises(PhaseError, match="KV handed off in ADMITTED"):
        request.handed_off(0.1, 3, MODEL.kv_bytes(3))
    request.leg_sent(decode=False)
    assert request.engine_ran and request.phase is RequestPhase.PREFILLING
    request.handed_off(0.1, 3, MODEL.kv_bytes(3))
    assert (request.phase, request.kv_bytes) == (RequestPhase.KV_TRANSFERRING, 3000)
    request.leg_sent(decode=True)
    assert request.decode_sent_at is not None


def test_fall_back_only_between_routing_and_the_first_token() -> None:
    request = admitted()
    with pytest.raises(PhaseError, match="fall back before routing"):
        request.fall_back("prefill_failed")
    request.route(ServingPath.DISAGGREGATED, "long_prompt", "decode-0", "prefill-0")
    request.fall_back("decode_failed", "decode-1")
    assert (request.path, request.path_reason, request.decode_worker) == (
        ServingPath.FALLBACK, "decode_failed", "decode-1",
    )  # fmt: skip
    request.mark_first_token()
    with pytest.raises(PhaseError, match="after the first token"):
        request.fall_back("decode_failed")
    request.abort()
    with pytest.raises(PhaseError, match="already ended as ABORTED"):
        request.count_output(1)
