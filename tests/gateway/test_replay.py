"""Idempotent replays: assembling a relayed stream into one body and re-chunking it (pure)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from core.messages import Endpoint
from gateway.serving.relay import split_finish_chunk
from gateway.serving.replay import StreamAssembler, rechunk
from tests.fakes.fake_engine import FakeEngine

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
GATEWAY_CREATED = 1_700_000_000
GATEWAY_IDS = {CHAT: "chatcmpl-gw-1", COMPLETIONS: "cmpl-gw-1"}
USAGE = {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
FINGERPRINT = "vllm-0.32.0-abcd1234"
# Longer than one piece, with characters outside ASCII, so pieces split on characters.
LONG = "Zürich → Genève: 🚄 " * 9


def chat_body(*choices: dict[str, Any], usage: dict[str, Any] | None = USAGE) -> dict[str, Any]:
    return {
        "id": GATEWAY_IDS[CHAT],
        "object": "chat.completion",
        "created": GATEWAY_CREATED,
        "model": "m",
        "choices": list(choices),
        "usage": usage,
        "system_fingerprint": FINGERPRINT,
    }


def chat_choice(index: int, content: str | None, finish: str = "stop", **extra: Any) -> dict:
    message = {"role": "assistant", "content": content, **extra.pop("message", {})}
    return {
        "index": index,
        "message": message,
        "logprobs": extra.pop("logprobs", None),
        "finish_reason": finish,
        "stop_reason": extra.pop("stop_reason", None),
    }


def completion_body(*choices: dict[str, Any], usage: dict[str, Any] | None = USAGE) -> dict:
    return {
        "id": GATEWAY_IDS[COMPLETIONS],
        "object": "text_completion",
        "created": GATEWAY_CREATED,
        "model": "m",
        "choices": list(choices),
        "usage": usage,
    }


def completion_choice(index: int, text: str, finish: str = "length", **extra: Any) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": extra.get("logprobs"),
        "finish_reason": finish,
        "stop_reason": extra.get("stop_reason"),
    }


TOOL_CALLS = [
    {
        "id": "call_a",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Zürich"}'},
    },
    {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}},
]
CHAT_LOGPROBS = {
    "content": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": []},
        {"token": "!", "logprob": -0.2, "bytes": [33], "top_logprobs": []},
    ]
}
COMPLETION_LOGPROBS = {
    "tokens": ["Hi", "!"],
    "token_logprobs": [-0.1, -0.2],
    "top_logprobs": [{"Hi": -0.1}, {"!": -0.2}],
    "text_offset": [0, 2],
}

BODIES = {
    "chat-1": (CHAT, chat_body(chat_choice(0, LONG))),
    "chat-2": (
        CHAT,
        chat_body(chat_choice(0, "short", stop_reason="###"), chat_choice(1, LONG, "length")),
    ),
    "chat-empty": (CHAT, chat_body(chat_choice(0, ""))),
    "chat-no-usage": (CHAT, chat_body(chat_choice(0, LONG), usage=None)),
    "chat-tools-reasoning": (
        CHAT,
        chat_body(
            chat_choice(
                0,
                None,
                "tool_calls",
                message={"tool_calls": TOOL_CALLS, "reasoning": "Two tools: " + LONG},
            ),
            chat_choice(1, "Hi!", logprobs=CHAT_LOGPROBS),
        ),
    ),
    "completions-1": (COMPLETIONS, completion_body(completion_choice(0, LONG))),
    "completions-2": (
        COMPLETIONS,
        completion_body(
            completion_choice(0, "Hi!", "stop", logprobs=COMPLETION_LOGPROBS),
            completion_choice(1, LONG, "stop", stop_reason=42),
        ),
    ),
    "completions-empty": (COMPLETIONS, completion_body(completion_choice(0, "", "stop"))),
}


def assemble(endpoint: Endpoint, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    assembler = StreamAssembler(endpoint)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.result()


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("name", BODIES)
def test_assembling_a_rechunked_body_gives_the_body_back(name: str, include_usage: bool) -> None:
    endpoint, body = BODIES[name]
    chunks = rechunk(body, endpoint, include_usage=include_usage, max_chars=5)
    assembler = StreamAssembler(endpoint)
    for chunk in chunks:
        assembler.add(chunk)
    if include_usage:
        assert assembler.result() == body
    else:
        # No usage chunk reached the client: the gateway adds the usage it got from the engine.
        assert assembler.result() == {**body, "usage": None}
        assembler.set_usage(body["usage"])
        assert assembler.result() == body


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("name", BODIES)
def test_rechunked_stream_has_the_openai_framing(name: str, include_usage: bool) -> None:
    endpoint, body = BODIES[name]
    chunks = rechunk(body, endpoint, include_usage=include_usage, max_chars=5)
    chat = endpoint is CHAT
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {
        (body["id"], body["created"], body["model"])
    }
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if chat else "text_completion"}
    if include_usage:
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"] == body["usage"]
        chunks = chunks[:-1]
    else:
        assert all("usage" not in c for c in chunks)
    assert all(len(c["choices"]) == 1 for c in chunks)
    for index in range(len(body["choices"])):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        finish = mine[-1]
        assert finish["finish_reason"] == body["choices"][index]["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])
        if chat:
            assert mine[0]["delta"] == {"role": "assistant", "content": ""}
            assert finish["delta"] == {}
            pieces = [c["delta"].get("content") for c in mine[1:-1]]
        else:
            assert finish["text"] == ""
            pieces = [c["text"] for c in mine[:-1]]
        assert all(len(p) <= 5 for p in pieces if p is not None)


def test_rechunk_splits_content_into_pieces_of_at_most_max_chars() -> None:
    body = chat_body(chat_choice(0, "abcdefghij"))
    chunks = rechunk(body, CHAT, include_usage=False, max_chars=4)
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": ""},
        {"content": "abcd"},
        {"content": "efgh"},
        {"content": "ij"},
        {},
    ]
    text = completion_body(completion_choice(0, "🚄🚄🚄"))
    chunks = rechunk(text, COMPLETIONS, include_usage=False, max_chars=2)
    assert [c["choices"][0]["text"] for c in chunks] == ["🚄🚄", "🚄", ""]
    with pytest.raises(ValueError, match="max_chars"):
        rechunk(body, CHAT, include_usage=False, max_chars=0)


def test_rechunk_interleaves_choices_and_assembly_accepts_any_interleaving() -> None:
    endpoint, body = BODIES["chat-2"]
    chunks = rechunk(body, endpoint, include_usage=True, max_chars=5)
    order = [c["choices"][0]["index"] for c in chunks[:-1]]
    assert order[:4] == [0, 1, 0, 1]  # role chunks first, as an engine sends them
    # Each choice's own order kept, the choices one after the other in reverse.
    by_choice = sorted(chunks[:-1], key=lambda c: -c["choices"][0]["index"])
    assert assemble(endpoint, [*by_choice, chunks[-1]]) == body


def test_replayed_stream_carries_logprobs_on_the_first_content_chunk() -> None:
    endpoint, body = BODIES["chat-tools-reasoning"]
    chunks = rechunk(body, endpoint, include_usage=False, max_chars=1)
    second = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == 1]
    assert [c["logprobs"] for c in second] == [None, CHAT_LOGPROBS, None, None, None]
    endpoint, body = BODIES["completions-2"]
    chunks = rechunk(body, endpoint, include_usage=False, max_chars=1)
    first = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == 0]
    assert [c["logprobs"] for c in first] == [COMPLETION_LOGPROBS, None, None, None]


def test_tool_call_deltas_merge_by_index() -> None:
    head = {"id": GATEWAY_IDS[CHAT], "object": "chat.completion.chunk", "created": GATEWAY_CREATED}
    head["model"] = "m"

    def delta(**d: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}

    def call(index: int, **fields: Any) -> dict[str, Any]:
        return delta(tool_calls=[{"index": index, **fields}])

    chunks = [
        delta(role="assistant", content=""),
        call(0, id="call_a", type="function", function={"name": "weather", "arguments": ""}),
        call(1, id="call_b", type="function", function={"name": "time"}),
        call(0, function={"arguments": '{"city": '}),
        call(1, function={"arguments": "{}"}),
        call(0, function={"arguments": '"Zürich"}'}),
        {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]
    result = assemble(CHAT, chunks)
    assert result["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": TOOL_CALLS},
            "logprobs": None,
            "finish_reason": "tool_calls",
            "stop_reason": None,
        }
    ]
    assert "system_fingerprint" not in result
    assert result["usage"] is None


def test_logprobs_lists_are_concatenated() -> None:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}

    def piece(text: str, i: int, finish: str | None = None) -> dict[str, Any]:
        logprobs = {key: values[i : i + 1] for key, values in COMPLETION_LOGPROBS.items()}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice]}

    result = assemble(COMPLETIONS, [piece("Hi", 0), piece("!", 1, "length")])
    assert result["choices"][0]["text"] == "Hi!"
    assert result["choices"][0]["logprobs"] == COMPLETION_LOGPROBS

    chat_head = {**head, "id": "chatcmpl-1", "object": "chat.completion.chunk"}
    entries = CHAT_LOGPROBS["content"]
    chunks = [
        {
            **chat_head,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": entry["token"]},
                    "logprobs": {"content": [entry], "refusal": None},
                    "finish_reason": None,
                }
            ],
        }
        for entry in entries
    ]
    result = assemble(CHAT, chunks)
    assert result["choices"][0]["logprobs"] == {"content": entries, "refusal": None}


def test_misuse_is_refused() -> None:
    assembler = StreamAssembler(CHAT)
    with pytest.raises(ValueError, match="no chunk"):
        assembler.result()
    with pytest.raises(ValueError, match="error event"):
        assembler.add({"error": {"message": "boom", "type": "x", "param": None, "code": None}})
    assembler.add({"id": "chatcmpl-a", "created": 1, "model": "m", "choices": []})
    with pytest.raises(ValueError, match="chatcmpl-b"):
        assembler.add({"id": "chatcmpl-b", "created": 1, "model": "m", "choices": []})


# A vLLM stream as the fake engine sends it (its module docstring has the exact shapes), then the
# gateway's relay steps, then the assembler.


def relay(chunks: list[dict[str, Any]], endpoint: Endpoint, include_usage: bool) -> list[dict]:
    """What ``gateway.serving.relay.Relay`` sends the client for these engine chunks."""
    content_key = "delta" if endpoint is CHAT else "text"
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        chunk = {**chunk, "id": GATEWAY_IDS[endpoint], "created": GATEWAY_CREATED}
        chunk.pop("kv_transfer_params", None)
        if not chunk["choices"]:
            if include_usage:
                out.append(chunk)
            continue
        if include_usage:
            chunk["usage"] = None
        else:
            chunk.pop("usage", None)
        out.extend(split_finish_chunk(chunk, content_key))
    return out


def test_a_relayed_vllm_chat_stream_assembles_into_the_final_body() -> None:
    head = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 5, "model": "m"}

    def token(i: int, text: str, finish: str | None = None, stop: Any = None) -> dict:
        choice: dict[str, Any] = {"index": i, "delta": {"content": text}, "logprobs": None}
        choice["finish_reason"] = finish
        if finish:
            choice["stop_reason"] = stop
        return {**head, "choices": [{**choice, "token_ids": None}]}

    def role(i: int) -> dict[str, Any]:
        choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        choice["finish_reason"] = None
        return {**head, "choices": [choice], "prompt_token_ids": None, "prompt_text": None}

    engine = [
        role(0),
        role(1),
        token(0, "alpha"),
        token(1, "kilo"),
        token(0, " bravo"),
        token(1, " lima", "length"),
        token(0, "", "stop"),  # EOS: a counted token without text, with the finish reason
        {**head, "choices": [], "usage": USAGE, "system_fingerprint": FINGERPRINT},
    ]
    expected = chat_body(chat_choice(0, "alpha bravo"), chat_choice(1, "kilo lima", "length"))

    sent = relay(engine, CHAT, include_usage=True)
    assert any(c["choices"] and c["choices"][0]["delta"] == {} for c in sent)  # split happened
    assert assemble(CHAT, sent) == expected

    sent = relay(engine, CHAT, include_usage=False)
    assembler = StreamAssembler(CHAT)
    for chunk in sent:
        assembler.add(chunk)
    assembler.set_usage(USAGE)
    # Without include_usage vLLM puts the fingerprint on the terminal chunk; this fake stream
    # left it on the dropped usage chunk only.
    assert assembler.result() == {
        key: value for key, value in expected.items() if key != "system_fingerprint"
    }


def test_a_relayed_vllm_completion_stream_assembles_into_the_final_body() -> None:
    head = {"id": "cmpl-x", "object": "text_completion", "created": 5, "model": "m"}

    def token(i: int, text: str, finish: str | None = None, stop: Any = None) -> dict:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        choice |= {"stop_reason": stop, "prompt_token_ids": None, "token_ids": None}
        return {**head, "choices": [choice]}

    engine = [
        token(0, "alpha"),
        token(0, " bra", "stop", "vo"),  # a stop string cut the last token
        {**head, "choices": [], "usage": USAGE},
    ]
    sent = relay(engine, COMPLETIONS, include_usage=True)
    assert len(sent) == 4  # the finishing token became a text chunk and a finish chunk
    assert assemble(COMPLETIONS, sent) == completion_body(
        completion_choice(0, "alpha bra", "stop", stop_reason="vo")
    )


# The fake engine's stream, relayed, must assemble into what the same engine answers without
# streaming: the stored body does not depend on how the first attempt asked.


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine("m", output_tokens=6) as fake:
        yield fake


def canonical(body: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """vLLM's non-streaming body reduced to the fields a stored body keeps."""
    keep = ("index", "logprobs", "finish_reason", "stop_reason")
    choices = []
    for choice in body["choices"]:
        if endpoint is CHAT:
            message = {"role": "assistant", "content": choice["message"]["content"]}
            choices.append({**{k: choice[k] for k in keep}, "message": message})
        else:
            choices.append({**{k: choice[k] for k in keep}, "text": choice["text"]})
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
    return {
        "id": GATEWAY_IDS[endpoint],
        "object": body["object"],
        "created": GATEWAY_CREATED,
        "model": body["model"],
        "choices": choices,
        "usage": usage,
        "system_fingerprint": body["system_fingerprint"],
    }


@pytest.mark.parametrize(
    ("endpoint", "request_body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hello there"}], "n": 2}),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        (COMPLETIONS, {"prompt": "once upon a time", "n": 2, "max_tokens": 4}),
        # Choice 1 hits the stop string (stop_reason " a"), choice 0 ends with EOS.
        (COMPLETIONS, {"prompt": "say it", "n": 2, "stop": [" a"], "max_tokens": 50}),
    ],
)
async def test_fake_engine_stream_assembles_into_its_non_streaming_answer(
    engine: FakeEngine, endpoint: Endpoint, request_body: dict[str, Any]
) -> None:
    url = engine.base_url + endpoint.value
    request_body = {"model": "m", **request_body}
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=request_body) as response:
            assert response.status == 200
            full = await response.json()
        stream_body = {**request_body, "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(url, json=stream_body) as response:
            assert response.status == 200
            text = await response.text()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    sent = relay([json.loads(e) for e in events[:-1]], endpoint, include_usage=True)
    expected = canonical(full, endpoint)
    assert assemble(endpoint, sent) == expected
    # And the stored body replays as a stream that assembles into it again.
    assert assemble(endpoint, rechunk(expected, endpoint, include_usage=True)) == expected
