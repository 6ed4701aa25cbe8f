"""``Idempotency-Key`` through the real gateway (docs/WIRE.md §3), against both idempotency stores:
the embedded in-memory one and a real Redis.

What a client sees: concurrent retries run once (the others get 409 ``idempotency_key_in_use``
with ``retry-after``), a retry after the end replays the answer (JSON or re-chunked SSE, same
``id``/``created``, ``Idempotent-Replayed: true``, not charged), a key reused with another body
is a 422, a request refused before any engine saw it leaves the key free, an engine error is
replayed as it was, a client that leaves an idempotent stream still gets the whole answer on
its retry, answers expire after the retention period, and keys are scoped by tenant and route.

Every request carries a fresh marker in its prompt, so ``_runs`` counts exactly the engine
executions of one test's body (with the fake stack every request is split: the prefill leg
goes to ``stack.prefill``, the decode leg to ``stack.decode``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import AsyncStream
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from admission.idempotency import MemoryIdempotencyStore, StoredResponse
from core.errors import ClientDisconnectedError, StoreUnavailableError
from core.messages import Endpoint
from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from gateway.serving.events import ResponseHead
from gateway.serving.hangup import HangUpSignal
from gateway.serving.idempotent import IdempotencyConfig, TeeSource
from gateway.serving.replay import StreamAssembler
from tests.fakes.fake_engine import FakeEngine, count_prompt_tokens
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack, wait_until

KEY_HEADER = "Idempotency-Key"
REPLAYED = "idempotent-replayed"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OUTPUT_TOKENS = 9
"""The fake's natural answer: 8 words and EOS (counted in usage, no text)."""
REDIS_DB = 13
"""The session's Redis database these tests own: the gateway's tenant registry has fixed key
names and every stack creates a ``default`` tenant, so each test starts from an empty one."""


# -- stacks over both stores -----------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreConfig]:
    if request.param == "memory":
        yield StoreConfig(sqlite_path=tmp_path / "tandem.db")
        return
    url: str = request.getfixturevalue("redis_url")
    own_url = f"{url.rsplit('/', 1)[0]}/{REDIS_DB}"
    with redis.Redis.from_url(own_url) as raw:
        raw.flushdb()
    yield StoreConfig(redis_url=own_url)


@asynccontextmanager
async def _stack(stores: StoreConfig, **gateway: Any) -> AsyncIterator[FakeStack]:
    access = AccessConfig(admin_key=ADMIN_KEY, stores=stores)
    async with make_fake_stack(access=access, gateway=gateway or None) as fake_stack:
        yield fake_stack


@pytest.fixture
async def stack(stores: StoreConfig) -> AsyncIterator[FakeStack]:
    # Heartbeats well after any refusal here (a failed split and its colocated fallback took
    # over 0.2 s on a loaded CI box), so an error before the first token is an HTTP status.
    async with _stack(stores, sse_ping_interval_s=2.0) as fake_stack:
        yield fake_stack


@pytest.fixture
async def http(stack: FakeStack) -> AsyncIterator[httpx.AsyncClient]:
    """Raw HTTP as the default tenant, for headers and bytes the SDK hides."""
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers=stack.auth_headers, timeout=15
    ) as client:
        yield client


# -- helpers ---------------------------------------------------------------------------------


def _marker() -> str:
    return f"marker-{uuid.uuid4().hex[:12]}"


def _messages(marker: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"Tell me a story about {marker}"}]


def _chat(marker: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": _messages(marker), "max_tokens": 32, **fields}


def _key() -> dict[str, str]:
    return {KEY_HEADER: f"key-{uuid.uuid4().hex}"}


def _runs(engine: FakeEngine, marker: str) -> int:
    """Requests ``engine`` received whose body carries ``marker``."""
    return sum(marker in json.dumps(seen["body"]) for seen in engine.stats.requests)


def _payloads(response: httpx.Response) -> list[Any]:
    """The SSE ``data:`` payloads of a stream, parsed (``[DONE]`` kept as the string)."""
    assert response.headers["content-type"].startswith("text/event-stream"), response.text
    return [
        line[6:] if line == "data: [DONE]" else json.loads(line[6:])
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]


@dataclass
class Streamed:
    """A chat stream as the SDK delivered it."""

    chunks: list[ChatCompletionChunk]

    @property
    def ids(self) -> set[str]:
        return {chunk.id for chunk in self.chunks}

    @property
    def created(self) -> set[int]:
        return {chunk.created for chunk in self.chunks}

    @property
    def content(self) -> str:
        return "".join(c.choices[0].delta.content or "" for c in self.chunks if c.choices)

    @property
    def finish_reasons(self) -> list[str]:
        return [
            c.choices[0].finish_reason
            for c in self.chunks
            if c.choices and c.choices[0].finish_reason
        ]

    @property
    def usages(self) -> list[Any]:
        return [chunk.usage for chunk in self.chunks if chunk.usage is not None]


async def _stream(
    client: openai.AsyncOpenAI, marker: str, headers: dict[str, str], **fields: Any
) -> tuple[Mapping[str, str], Streamed]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages(marker), stream=True, extra_headers=headers,
        **{"max_tokens": 32, **fields},
    )  # fmt: skip
    stream = raw.parse()
    assert isinstance(stream, AsyncStream)
    return raw.headers, Streamed([chunk async for chunk in stream])


async def _json(
    client: openai.AsyncOpenAI, marker: str, headers: dict[str, str], **fields: Any
) -> tuple[Mapping[str, str], ChatCompletion]:
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=_messages(marker), extra_headers=headers,
        **{"max_tokens": 32, **fields},
    )  # fmt: skip
    answer = raw.parse()
    assert isinstance(answer, ChatCompletion)
    return raw.headers, answer


def _usage_numbers(usage: Any) -> tuple[int, int, int]:
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    return error


async def _until_settled(
    send: Callable[[], Awaitable[httpx.Response]], timeout_s: float = 5.0
) -> httpx.Response:
    """``send()`` again while it answers 409 (the key's run is still being stored)."""
    deadline = time.monotonic() + timeout_s
    while (response := await send()).status_code == 409:
        assert _error(response)["code"] == "idempotency_key_in_use"
        assert time.monotonic() < deadline, "the key stayed in use"
        await asyncio.sleep(0.02)
    return response


# -- 1. concurrent retries run once ----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_concurrent_requests_with_one_key_run_once(stack: FakeStack, stream: bool) -> None:
    marker, key = _marker(), _key()
    # Streams read the delay per token, so it can be cut once every loser has its answer;
    # a non-streaming answer takes the whole delay (8 gaps) in one sleep.
    stack.decode.token_delay_s = 1.0 if stream else 0.2

    async def one() -> Any:
        return await stack.client.chat.completions.create(
            model=MODEL, messages=_messages(marker), max_tokens=32, stream=stream, extra_headers=key
        )

    outcomes = await asyncio.gather(*(one() for _ in range(50)), return_exceptions=True)
    stack.decode.token_delay_s = 0.0

    conflicts = [o for o in outcomes if isinstance(o, openai.ConflictError)]
    answers = [o for o in outcomes if not isinstance(o, BaseException)]
    others = [o for o in outcomes if isinstance(o, BaseException) and o not in conflicts]
    assert not others, others
    assert len(answers) == 1 and len(conflicts) == 49
    for conflict in conflicts:
        assert conflict.status_code == 409
        assert conflict.code == "idempotency_key_in_use"
        assert 1 <= int(conflict.response.headers["retry-after"]) <= 10
    if stream:
        chunks = [chunk async for chunk in answers[0]]
        content = Streamed(chunks).content
    else:
        content = answers[0].choices[0].message.content
    assert content and len(content.split()) == OUTPUT_TOKENS - 1
    assert _runs(stack.decode, marker) == 1
    assert _runs(stack.prefill, marker) == 1


# -- 2. replays: JSON and SSE, not charged ---------------------------------------------------


async def test_a_json_answer_replays_as_json_and_as_streams(stack: FakeStack) -> None:
    marker, key = _marker(), _key()
    headers, original = await _json(stack.client, marker, key)
    assert REPLAYED not in headers
    assert original.usage is not None and original.choices[0].message.content
    assert _runs(stack.decode, marker) == 1

    headers, replayed = await _json(stack.client, marker, key)
    assert headers[REPLAYED] == "true"
    assert replayed.model_dump() == original.model_dump()  # the stored bytes, as they were

    for include_usage in (False, True):
        options = {"stream_options": {"include_usage": True}} if include_usage else {}
        headers, streamed = await _stream(stack.client, marker, key, **options)
        assert headers[REPLAYED] == "true"
        assert headers["content-type"].startswith("text/event-stream")
        assert streamed.ids == {original.id}
        assert streamed.created == {original.created}
        assert streamed.content == original.choices[0].message.content
        assert streamed.finish_reasons == [original.choices[0].finish_reason]
        if include_usage:
            assert len(streamed.usages) == 1 and streamed.chunks[-1].choices == []
            assert _usage_numbers(streamed.usages[0]) == _usage_numbers(original.usage)
        else:
            assert streamed.usages == []
    assert _runs(stack.decode, marker) == 1
    assert _runs(stack.prefill, marker) == 1


async def test_a_replay_is_not_charged(stack: FakeStack) -> None:
    marker, key = _marker(), _key()
    api_key = await stack.new_tenant("one-a-minute", rpm=1)
    async with stack.client_for(api_key) as client:
        headers, original = await _json(client, marker, key)
        assert headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError):  # a fresh request is over the plan
            await _json(client, marker, {})
        before = (await stack.admin.get("/admin/v1/tenants/one-a-minute/usage")).json()

        headers, replayed = await _json(client, marker, key)
        assert headers[REPLAYED] == "true" and replayed.id == original.id
        headers, streamed = await _stream(client, marker, key)
        assert (
            headers[REPLAYED] == "true" and streamed.content == original.choices[0].message.content
        )
        assert not [name for name in headers if name.startswith("x-ratelimit-")]

        after = (await stack.admin.get("/admin/v1/tenants/one-a-minute/usage")).json()
    assert after["requests"]["remaining"] == before["requests"]["remaining"] == 0
    assert after["concurrent"] == 0
    assert _runs(stack.decode, marker) == 1


# -- 3. a stream replays as JSON -------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [False, True], ids=["no-usage", "usage"])
async def test_a_streamed_answer_replays_as_json(stack: FakeStack, include_usage: bool) -> None:
    marker, key = _marker(), _key()
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    headers, original = await _stream(stack.client, marker, key, **options)
    assert REPLAYED not in headers
    assert len(original.ids) == 1 and len(original.created) == 1
    assert len(original.usages) == (1 if include_usage else 0)

    # At once: a client that read [DONE] and retries finds the answer stored.
    headers, replayed = await _json(stack.client, marker, key)
    assert headers[REPLAYED] == "true"
    assert {replayed.id} == original.ids and {replayed.created} == original.created
    assert replayed.choices[0].message.content == original.content
    assert [replayed.choices[0].finish_reason] == original.finish_reasons
    # The engine's usage is stored even when the client did not ask for it.
    assert replayed.usage is not None
    prompt_tokens = count_prompt_tokens(CHAT, {"messages": _messages(marker)})
    expected = (prompt_tokens, OUTPUT_TOKENS, prompt_tokens + OUTPUT_TOKENS)
    assert _usage_numbers(replayed.usage) == expected
    if include_usage:
        assert _usage_numbers(original.usages[0]) == expected

    headers, again = await _stream(stack.client, marker, key, **options)
    assert headers[REPLAYED] == "true"
    assert again.ids == original.ids and again.content == original.content
    assert [_usage_numbers(u) for u in again.usages] == [_usage_numbers(u) for u in original.usages]
    assert _runs(stack.decode, marker) == 1


# -- 4. same key, another body ---------------------------------------------------------------


async def test_a_key_reused_with_another_body_is_422(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    marker, key = _marker(), _key()
    stack.decode.token_delay_s = 1.0
    async with http.stream("POST", CHAT, json=_chat(marker, stream=True), headers=key) as running:
        assert running.status_code == 200
        lines = running.aiter_lines()
        while not (await anext(lines)).startswith("data: "):
            pass  # until the first chunk: it is decoding
        other = await http.post(CHAT, json=_chat(marker, max_tokens=31), headers=key)
        assert other.status_code == 422, other.text
        assert _error(other)["code"] == "idempotency_key_reused"
        same = await http.post(CHAT, json=_chat(marker), headers=key)  # stream is not the body
        assert same.status_code == 409 and _error(same)["code"] == "idempotency_key_in_use"
        stack.decode.token_delay_s = 0.0
        rest = [line async for line in lines]
    assert "data: [DONE]" in rest

    done = await http.post(CHAT, json=_chat(marker), headers=key)
    assert done.status_code == 200 and done.headers[REPLAYED] == "true"  # completed now
    after = await http.post(CHAT, json=_chat(marker, temperature=0.5), headers=key)
    assert after.status_code == 422, after.text
    assert _error(after)["code"] == "idempotency_key_reused"
    assert _error(after)["param"] == KEY_HEADER
    assert _runs(stack.decode, marker) == 1


# -- 5. refused before execution: nothing stored ---------------------------------------------


async def test_a_request_refused_at_admission_leaves_the_key_free(stack: FakeStack) -> None:
    marker, key = _marker(), _key()
    api_key = await stack.new_tenant("capped", max_output_tokens=16)
    async with stack.client_for(api_key) as client:
        for send in (_stream, _json):  # the 400 is not stored: the same body is refused again
            with pytest.raises(openai.BadRequestError) as refused:
                await send(client, marker, key, max_tokens=100)
            assert refused.value.code == "max_tokens_too_large"
            assert REPLAYED not in refused.value.response.headers
        assert _runs(stack.decode, marker) == 0
        headers, answer = await _json(client, marker, key, max_tokens=8)  # not a 422
    assert REPLAYED not in headers
    assert answer.choices[0].finish_reason == "length"
    assert _runs(stack.decode, marker) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_rate_limited_request_leaves_the_key_free(stack: FakeStack, stream: bool) -> None:
    marker, key = _marker(), _key()
    api_key = await stack.new_tenant("one-a-minute", rpm=1)
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=15
    ) as http:
        assert (await http.post(CHAT, json=_chat(_marker()))).status_code == 200
        body = _chat(marker, stream=stream)
        limited = await http.post(CHAT, json=body, headers=key)
        assert limited.status_code == 429, limited.text
        assert REPLAYED not in limited.headers
        lifted = await stack.admin.patch("/admin/v1/tenants/one-a-minute", json={"rpm": None})
        assert lifted.status_code == 200, lifted.text

        async def send() -> httpx.Response:
            return await http.post(CHAT, json=body, headers=key)

        # Until the plan change reaches the key cache, the retry is refused again, and again
        # stores nothing; then it runs.
        deadline = time.monotonic() + 5
        while (answer := await send()).status_code == 429:
            assert time.monotonic() < deadline, "the lifted limit never applied"
            await asyncio.sleep(0.05)
    assert answer.status_code == 200, answer.text
    assert REPLAYED not in answer.headers
    assert _runs(stack.decode, marker) == 1


async def test_no_healthy_decode_worker_leaves_the_key_free(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    marker, key = _marker(), _key()
    stack.decode.healthy = False
    await wait_until(lambda: not any(w.healthy for w in stack.decode_pool.workers))
    for stream in (False, True):
        refused = await http.post(CHAT, json=_chat(marker, stream=stream), headers=key)
        assert refused.status_code == 503, refused.text
        assert _error(refused)["code"] == "no_healthy_worker"
    stack.decode.healthy = True
    await wait_until(lambda: all(w.healthy for w in stack.decode_pool.workers))
    answer = await http.post(CHAT, json=_chat(marker), headers=key)
    assert answer.status_code == 200, answer.text
    assert REPLAYED not in answer.headers
    assert _runs(stack.decode, marker) == 1

    stack.decode.healthy = False  # a replay needs no engine
    await wait_until(lambda: not any(w.healthy for w in stack.decode_pool.workers))
    replayed = await http.post(CHAT, json=_chat(marker, stream=True), headers=key)
    assert replayed.status_code == 200 and replayed.headers[REPLAYED] == "true"
    assert {p["id"] for p in _payloads(replayed) if p != "[DONE]"} == {answer.json()["id"]}


# -- 6. engine errors are stored and replayed ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_an_engine_error_is_replayed(
    stack: FakeStack, http: httpx.AsyncClient, stream: bool
) -> None:
    marker, key = _marker(), _key()
    stack.decode.fail_status = 500  # the split attempt and the colocated fallback both fail
    failed = await http.post(CHAT, json=_chat(marker, stream=stream), headers=key)
    assert failed.status_code == 502, failed.text
    assert _error(failed)["code"] == "engine_error"
    assert REPLAYED not in failed.headers
    runs = _runs(stack.decode, marker)
    assert runs == 2

    stack.decode.fail_status = None  # a healthy engine now: the retry still gets the error
    for retry_stream in (False, True):
        replayed = await http.post(CHAT, json=_chat(marker, stream=retry_stream), headers=key)
        assert replayed.status_code == 502
        assert replayed.headers[REPLAYED] == "true"
        assert replayed.headers["x-should-retry"] == "false"  # it would only replay again
        assert replayed.json() == failed.json()
    assert _runs(stack.decode, marker) == runs


async def test_a_mid_stream_error_is_stored_as_the_error(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    marker, key = _marker(), _key()
    stack.decode.error_after_tokens = 3
    original = await http.post(CHAT, json=_chat(marker, stream=True), headers=key)
    assert original.status_code == 200  # committed: the error is the stream's last event
    payloads = _payloads(original)
    error_event = payloads[-1]
    assert set(error_event) == {"error"} and error_event["error"]["code"] == "engine_error"
    assert any(p.get("choices") for p in payloads[:-1])
    assert _runs(stack.decode, marker) == 1

    stack.decode.error_after_tokens = None
    # docs/WIRE.md §3: the stored result is the engine error; a retry gets it with the error's own
    # status (a replay has no partial answer to stream first), as JSON or as a stream.
    for retry_stream in (True, False):
        replayed = await http.post(CHAT, json=_chat(marker, stream=retry_stream), headers=key)
        assert replayed.status_code == 502, replayed.text
        assert replayed.headers[REPLAYED] == "true"
        assert replayed.json() == error_event
    assert _runs(stack.decode, marker) == 1


# -- 7. a client that leaves still gets the whole answer -------------------------------------


async def test_a_client_leaving_an_idempotent_stream_gets_the_whole_answer_on_retry(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    marker, key = _marker(), _key()
    stack.decode.token_delay_s = 0.15  # about 1.2 s of generation after the client leaves
    body = _chat(marker, stream=True)
    async with http.stream("POST", CHAT, json=body, headers=key) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break  # the first token: leave
    # The engine runs to its natural end: the gateway did not abort it.
    await wait_until(lambda: stack.decode.stats.finished.get("stop", 0) == 1)
    assert stack.decode.stats.num_aborted == 0
    assert stack.decode.stats.finished == {"stop": 1}

    async def retry() -> httpx.Response:
        return await http.post(CHAT, json=body, headers=key)

    replayed = await _until_settled(retry)
    assert replayed.status_code == 200
    assert replayed.headers[REPLAYED] == "true"
    chunks = [p for p in _payloads(replayed) if p != "[DONE]"]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert _payloads(replayed)[-1] == "[DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert _runs(stack.decode, marker) == 1

    stack.decode.token_delay_s = 0.0
    fresh = await stack.client.chat.completions.create(
        model=MODEL,
        messages=_messages(marker),
        max_tokens=32,
    )  # the fake answers a prompt the same way every time: the whole answer
    assert content == fresh.choices[0].message.content
    assert len(content.split()) == OUTPUT_TOKENS - 1


async def test_a_client_leaving_before_the_first_token_stops_its_wait_not_the_run() -> None:
    """The response opens an idempotent stream in the handler's task: a hang-up ends that
    wait at once, while the background run still opens and finishes for the retry."""
    hang_up = HangUpSignal()
    tee = TeeSource(ResponseHead({}), StreamAssembler(Endpoint.CHAT), hang_up)
    waiting = asyncio.ensure_future(tee.open_stream())
    await asyncio.sleep(0)
    assert not waiting.done()
    hang_up.fire()
    with pytest.raises(ClientDisconnectedError):
        await asyncio.wait_for(waiting, timeout=5)
    assert not tee.opened.done(), "the run opens it, whoever waits"
    tee.opened.set_result(None)


async def test_a_client_leaving_an_idempotent_request_gets_the_answer_on_retry(
    stack: FakeStack, http: httpx.AsyncClient
) -> None:
    marker, key = _marker(), _key()
    stack.decode.token_delay_s = 0.1  # a non-streaming answer after 0.8 s
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and hangs up
        await http.post(CHAT, json=_chat(marker), headers=key, timeout=0.3)
    await wait_until(lambda: stack.decode.stats.finished.get("stop", 0) == 1)
    assert stack.decode.stats.num_aborted == 0

    async def retry() -> httpx.Response:
        return await http.post(CHAT, json=_chat(marker), headers=key)

    replayed = await _until_settled(retry)
    assert replayed.status_code == 200 and replayed.headers[REPLAYED] == "true"
    assert len(replayed.json()["choices"][0]["message"]["content"].split()) == OUTPUT_TOKENS - 1
    assert _runs(stack.decode, marker) == 1


# -- 8. expiry -------------------------------------------------------------------------------


async def test_an_answer_expires_after_the_retention(stores: StoreConfig) -> None:
    retention = IdempotencyConfig(retention_s=1.0)
    async with _stack(stores, idempotency=retention) as stack:
        marker, key = _marker(), _key()
        _, original = await _json(stack.client, marker, key)
        headers, replayed = await _json(stack.client, marker, key)
        assert headers[REPLAYED] == "true" and replayed.id == original.id

        deadline = time.monotonic() + 5
        while REPLAYED in (result := await _json(stack.client, marker, key))[0]:
            assert result[1].id == original.id
            assert time.monotonic() < deadline, "the answer never expired"
            await asyncio.sleep(0.05)
        assert result[1].id != original.id
        assert _runs(stack.decode, marker) == 2


# -- 9. scope: tenant + route + key ----------------------------------------------------------


async def test_one_key_in_two_tenants_runs_twice(stack: FakeStack) -> None:
    marker, key = _marker(), _key()
    other_key = await stack.new_tenant("other")
    async with stack.client_for(other_key) as other:
        headers_a, answer_a = await _json(stack.client, marker, key)
        headers_b, answer_b = await _json(other, marker, key)
        assert REPLAYED not in headers_a and REPLAYED not in headers_b
        assert answer_a.id != answer_b.id
        assert _runs(stack.decode, marker) == 2
        # Each tenant's retry replays its own answer.
        assert (await _json(stack.client, marker, key))[1].id == answer_a.id
        assert (await _json(other, marker, key))[1].id == answer_b.id
    assert _runs(stack.decode, marker) == 2


async def test_one_key_on_two_routes_is_two_keys(stack: FakeStack) -> None:
    marker, key = _marker(), _key()
    _, chat = await _json(stack.client, marker, key)
    raw = await stack.client.completions.with_raw_response.create(
        model=MODEL, prompt=f"Tell me a story about {marker}", max_tokens=16, extra_headers=key
    )
    assert REPLAYED not in raw.headers  # not a 422 for the chat body, not the chat answer
    completion = raw.parse()
    assert completion.object == "text_completion" and completion.choices[0].text
    assert _runs(stack.decode, marker) == 2
    raw = await stack.client.completions.with_raw_response.create(
        model=MODEL, prompt=f"Tell me a story about {marker}", max_tokens=16, extra_headers=key
    )
    assert raw.headers[REPLAYED] == "true" and raw.parse().id == completion.id
    streamed = await stack.client.completions.create(
        model=MODEL, prompt=f"Tell me a story about {marker}", max_tokens=16, stream=True,
        extra_headers=key,
    )  # fmt: skip
    chunks = [chunk async for chunk in streamed]
    assert {chunk.id for chunk in chunks} == {completion.id}
    assert "".join(c.choices[0].text for c in chunks) == completion.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        completion.choices[0].finish_reason
    ]
    assert (await _json(stack.client, marker, key))[1].id == chat.id
    assert _runs(stack.decode, marker) == 2


# -- 10. the header ---------------------------------------------------------------------------


async def test_a_quoted_key_is_the_same_key(stack: FakeStack, http: httpx.AsyncClient) -> None:
    marker, bare = _marker(), f"abc-{uuid.uuid4().hex}"
    first = await http.post(CHAT, json=_chat(marker), headers={KEY_HEADER: bare})
    assert first.status_code == 200 and REPLAYED not in first.headers
    quoted = await http.post(CHAT, json=_chat(marker), headers={KEY_HEADER: f'"{bare}"'})
    assert quoted.status_code == 200
    assert quoted.headers[REPLAYED] == "true"
    assert quoted.json()["id"] == first.json()["id"]
    assert _runs(stack.decode, marker) == 1


@pytest.mark.parametrize(
    "value",
    ["k" * 256, "", '""', '"unterminated'],
    ids=["too-long", "empty", "empty-quoted", "bad-quote"],
)
async def test_an_invalid_key_is_400(stack: FakeStack, http: httpx.AsyncClient, value: str) -> None:
    marker = _marker()
    for stream in (False, True):
        refused = await http.post(
            CHAT, json=_chat(marker, stream=stream), headers={KEY_HEADER: value}
        )
        assert refused.status_code == 400, refused.text
        error = _error(refused)
        assert error["param"] == KEY_HEADER and error["type"] == "invalid_request_error"
    assert _runs(stack.decode, marker) == 0
    longest = (marker + "k" * 255)[:255]
    accepted = await http.post(CHAT, json=_chat(marker), headers={KEY_HEADER: longest})
    assert accepted.status_code == 200, accepted.text
    assert _runs(stack.decode, marker) == 1


# -- the key is settled before the client hears the end --------------------------------------

STORE_WRITE_S = 0.3


class SlowWritingStore(MemoryIdempotencyStore):
    """A store whose writes take a while (a loaded Redis): a client that heard the end of its
    request and retries at once must still find the answer stored or the key free, not 409."""

    async def complete(
        self, scope: str, token: str, response: StoredResponse, retention_s: float
    ) -> bool:
        await asyncio.sleep(STORE_WRITE_S)
        return await super().complete(scope, token, response, retention_s)

    async def release(self, scope: str, token: str) -> None:
        await asyncio.sleep(STORE_WRITE_S)
        await super().release(scope, token)


@pytest.fixture
async def slow_store_stack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> AsyncIterator[FakeStack]:
    monkeypatch.setattr("gateway.assembly.stores.MemoryIdempotencyStore", SlowWritingStore)
    # Heartbeats later than a store write, so a refused stream's status is still an HTTP one.
    async with _stack(
        StoreConfig(sqlite_path=tmp_path / "tandem.db"), sse_ping_interval_s=1.0
    ) as fake_stack:
        yield fake_stack


async def test_a_stream_is_stored_before_its_last_event(slow_store_stack: FakeStack) -> None:
    stack, marker, key = slow_store_stack, _marker(), _key()
    _, original = await _stream(stack.client, marker, key)
    headers, replayed = await _json(stack.client, marker, key)  # not 409
    assert headers[REPLAYED] == "true" and {replayed.id} == original.ids


async def test_a_stream_refused_before_its_first_byte_is_settled_first(
    slow_store_stack: FakeStack,
) -> None:
    stack, marker, key = slow_store_stack, _marker(), _key()
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers=stack.auth_headers, timeout=15
    ) as http:
        stack.decode.fail_status = 500  # the engine ran: the 502 is stored
        failed = await http.post(CHAT, json=_chat(marker, stream=True), headers=key)
        assert failed.status_code == 502, failed.text
        replayed = await http.post(CHAT, json=_chat(marker, stream=True), headers=key)
        assert replayed.status_code == 502 and replayed.headers[REPLAYED] == "true"
        stack.decode.fail_status = None

    api_key = await stack.new_tenant("capped", max_output_tokens=16)
    async with stack.client_for(api_key) as client:
        with pytest.raises(openai.BadRequestError):  # no engine saw it: the key is freed
            await _stream(client, marker, key, max_tokens=100)
        headers, answer = await _stream(client, marker, key, max_tokens=8)  # not 409
    assert REPLAYED not in headers and answer.finish_reasons == ["length"]


class UnwritableStore(MemoryIdempotencyStore):
    """Claims work, storing the answer fails (Redis went away mid-request)."""

    async def complete(
        self, scope: str, token: str, response: StoredResponse, retention_s: float
    ) -> bool:
        raise StoreUnavailableError("the idempotency store is unavailable")


async def test_an_answer_that_cannot_be_stored_still_reaches_the_client(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("gateway.assembly.stores.MemoryIdempotencyStore", UnwritableStore)
    async with _stack(StoreConfig(sqlite_path=tmp_path / "tandem.db")) as stack:
        _, answer = await _json(stack.client, _marker(), _key())
        assert answer.choices[0].finish_reason == "stop"
        _, streamed = await _stream(stack.client, _marker(), _key())
        assert streamed.finish_reasons == ["stop"]
