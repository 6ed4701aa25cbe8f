"""Quotas and fair admission through the real gateway: rate-limit headers, 429s the OpenAI SDK
understands, reconciliation, plan limits, concurrency, the fair queue, and the quota store's
failure policy. The quota tests run against both stores (in memory, and a real Redis)."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from admission.controller import ControllerConfig, StoreFailurePolicy
from core.models import ServedModel
from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack, wait_until
from tests.redis_server import RedisServer, running_redis

QUESTION_TEXT = "What is the capital of France?"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION_TEXT}]
# The gateway's estimate of QUESTION (no tokenizer file: 4 characters per token): 30 characters
# -> 8 tokens, + 4 for the message's template + 3 for the reply's priming.
QUESTION_TOKENS = 15
DURATION = re.compile(r"^(\d+ms|\d+(\.\d+)?s|\d+m\d+s|\d+h\d+m\d+s)$")
RATELIMIT_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreConfig]:
    """Each quota test against the in-memory store and against a real Redis (a private server:
    the registry's key names are fixed, and every stack creates a ``default`` tenant)."""
    if request.param == "memory":
        yield StoreConfig(sqlite_path=tmp_path / "tandem.db")
    else:
        with running_redis() as server:
            yield StoreConfig(redis_url=server.url)


def _access(tmp_path: Path, **options: Any) -> AccessConfig:
    options.setdefault("stores", StoreConfig(sqlite_path=tmp_path / "tandem.db"))
    return AccessConfig(admin_key=ADMIN_KEY, **options)


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[FakeStack]:
    async with make_fake_stack(access=_access(tmp_path)) as fake_stack:
        yield fake_stack


@pytest.fixture
async def quota_stack(store: StoreConfig, tmp_path: Path) -> AsyncIterator[FakeStack]:
    async with make_fake_stack(access=_access(tmp_path, stores=store)) as fake_stack:
        yield fake_stack


@asynccontextmanager
async def _one_slot_stack(tmp_path: Path, http: str | None = None) -> AsyncIterator[FakeStack]:
    access = _access(tmp_path, max_in_flight_per_worker=1, max_queue=4)
    async with make_fake_stack(access=access, http=http) as fake_stack:
        fake_stack.decode.token_delay_s = 0.2
        yield fake_stack


@pytest.fixture
async def one_slot(tmp_path: Path) -> AsyncIterator[FakeStack]:
    """A gateway that runs one request at a time (one decode worker, one request each), so a
    second request waits in the fair queue; its decode engine is slow until a test says."""
    async with _one_slot_stack(tmp_path) as fake_stack:
        yield fake_stack


def _chat(content: str = QUESTION_TEXT, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


async def _post(stack: FakeStack, api_key: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=30) as http:
        return await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}
        )


async def _usage(stack: FakeStack, tenant: str) -> dict[str, Any]:
    response = await stack.admin.get(f"/admin/v1/tenants/{tenant}/usage")
    assert response.status_code == 200, response.text
    usage: dict[str, Any] = response.json()
    return usage


async def _settled(stack: FakeStack, tenant: str) -> dict[str, Any]:
    """The tenant's usage once none of its requests holds a slot. A stream is settled after
    its last byte is sent, so a client that just read ``[DONE]`` may ask before that."""
    deadline = time.monotonic() + 5
    while (usage := await _usage(stack, tenant))["concurrent"] != 0:
        assert time.monotonic() < deadline, f"{tenant} still holds {usage['concurrent']} slots"
        await asyncio.sleep(0.02)
    return usage


async def _metric(stack: FakeStack, name: str, **labels: str) -> float:
    """One sample of the gateway's ``/metrics`` (0 when absent: counters start unexported)."""
    async with httpx.AsyncClient(base_url=stack.base_url) as http:
        text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


async def _wait_for_metric(stack: FakeStack, name: str, value: float, **labels: str) -> None:
    deadline = time.monotonic() + 5
    while (current := await _metric(stack, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name} is {current}, never {value}"
        await asyncio.sleep(0.02)


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["code"], str)
    return error


@asynccontextmanager
async def _holding_the_slot(stack: FakeStack) -> AsyncIterator[openai.AsyncStream[Any]]:
    """A slow stream of the default tenant, admitted and running, closed on exit."""
    stack.decode.output_tokens = 1000  # no natural stop: it runs until closed or max_tokens
    stream = await stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=200, stream=True
    )
    try:
        async for _ in stream:
            break  # the first chunk: it is admitted and decoding
        yield stream
    finally:
        await stream.close()


# -- headers ---------------------------------------------------------------------------------


async def test_ratelimit_headers_on_plain_and_streaming_responses(quota_stack: FakeStack) -> None:
    stack = quota_stack
    api_key = await stack.new_tenant("acme", rpm=100, tpm=6000)
    async with stack.client_for(api_key) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=QUESTION, max_tokens=10
        )
        # The first reservation meets full buckets, so every value is exact: one request of
        # 100/min refills in 0.6 s, 25 tokens of 6000/min in 0.25 s.
        assert {name: raw.headers[name] for name in RATELIMIT_HEADERS} == {
            "x-ratelimit-limit-requests": "100",
            "x-ratelimit-remaining-requests": "99",
            "x-ratelimit-reset-requests": "600ms",
            "x-ratelimit-limit-tokens": "6000",
            "x-ratelimit-remaining-tokens": str(6000 - QUESTION_TOKENS - 10),
            "x-ratelimit-reset-tokens": "250ms",
        }
        assert raw.parse().choices[0].message.content

        streamed = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=QUESTION, max_tokens=10, stream=True
        )
        headers = streamed.headers
        chunks = [chunk async for chunk in streamed.parse()]
    assert chunks[-1].choices[0].finish_reason is not None
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["x-ratelimit-limit-requests"] == "100"
    assert headers["x-ratelimit-limit-tokens"] == "6000"
    # The buckets refilled a little since: at most back to where the first request left them.
    assert int(headers["x-ratelimit-remaining-requests"]) <= 99
    assert int(headers["x-ratelimit-remaining-tokens"]) <= 6000 - QUESTION_TOKENS - 10
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        assert DURATION.match(headers[name]), headers[name]


async def test_an_unlimited_plan_sends_no_ratelimit_headers(stack: FakeStack) -> None:
    response = await _post(stack, stack.api_key, _chat(max_tokens=4))
    assert response.status_code == 200
    assert not [name for name in response.headers if name.startswith("x-ratelimit-")]


# -- 429s ------------------------------------------------------------------------------------


async def test_rpm_exhausted_is_429_with_retry_hints(quota_stack: FakeStack) -> None:
    stack = quota_stack
    api_key = await stack.new_tenant("acme", rpm=2, tpm=6000)
    for _ in range(2):
        assert (await _post(stack, api_key, _chat(max_tokens=4))).status_code == 200

    refused = await _post(stack, api_key, _chat(max_tokens=4))
    assert refused.status_code == 429
    error = _error(refused)
    assert error["code"] == "rate_limit_exceeded"
    assert "requests per minute (2)" in error["message"]
    # One request of 2/min refills in 30 s: that is the wait, well under the SDK's 120 s cap.
    assert 1 <= int(refused.headers["retry-after"]) <= 30
    assert 0 < int(refused.headers["retry-after-ms"]) <= 30_000
    assert "x-should-retry" not in refused.headers
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert DURATION.match(refused.headers["x-ratelimit-reset-requests"])

    async with stack.client_for(api_key) as client:
        with pytest.raises(openai.RateLimitError) as caught:
            await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert caught.value.status_code == 429
    assert caught.value.code == "rate_limit_exceeded"
    # Refused before the engines: only the two admitted requests ran, and nothing stays held.
    assert stack.decode.stats.num_requests == 2
    usage = await _usage(stack, "acme")
    assert usage["concurrent"] == 0
    assert usage["requests"]["remaining"] == 0


async def test_a_request_larger_than_tpm_is_400_naming_the_parameter(
    quota_stack: FakeStack,
) -> None:
    """It can never pass, so it is not a 429: clients retry those, whatever x-should-retry says."""
    stack = quota_stack
    api_key = await stack.new_tenant("acme", tpm=100)
    refused = await _post(stack, api_key, _chat(max_tokens=200))
    assert refused.status_code == 400
    error = _error(refused)
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "request_too_large", "max_tokens",
    )  # fmt: skip
    # It says what would fit: 100 tokens a minute less the prompt's estimate.
    assert f"max_tokens to {100 - QUESTION_TOKENS} or less" in error["message"]
    completion_tokens = await _post(
        stack, api_key, {**_chat(), "max_completion_tokens": 200, "n": 2}
    )
    assert completion_tokens.status_code == 400
    assert _error(completion_tokens)["param"] == "max_completion_tokens"
    prompt_alone = await _post(stack, api_key, _chat("word " * 200, max_tokens=1))
    assert prompt_alone.status_code == 400
    assert (_error(prompt_alone)["code"], _error(prompt_alone)["param"]) == (
        "request_too_large", "messages",
    )  # fmt: skip

    # The official client, with its default retries, does not retry a 400.
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=2)
    async with client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=200)
    assert (caught.value.code, caught.value.param) == ("request_too_large", "max_tokens")
    rejections = await _metric(stack, "tandem_admission_rejections_total", code="request_too_large")
    assert rejections == 4, "one refusal each: the SDK did not retry"
    # Nothing was taken: a request that fits still passes with the whole bucket.
    fits = await _post(stack, api_key, _chat(max_tokens=10))
    assert fits.status_code == 200
    assert fits.headers["x-ratelimit-remaining-tokens"] == str(100 - QUESTION_TOKENS - 10)


async def test_a_chat_request_without_max_tokens_gets_the_models_default_cap(
    tmp_path: Path,
) -> None:
    """Unset max_tokens means "up to the context window": one question could stream for
    minutes. The served model's default caps it (listed in /v1/models); a plan's cap wins."""
    model = ServedModel(MODEL, 256, 0, default_max_tokens=12)
    async with make_fake_stack(access=_access(tmp_path), model=model) as stack:
        listed = (await stack.client.models.list()).data[0]
        assert listed.model_extra is not None
        assert (listed.model_extra["default_max_tokens"], listed.model_extra["max_model_len"]) == (
            12, 256,
        )  # fmt: skip

        assert (await _post(stack, stack.api_key, _chat())).status_code == 200
        assert stack.decode.stats.requests[-1]["body"]["max_tokens"] == 12
        capped = await stack.new_tenant("capped", max_output_tokens=20)
        assert (await _post(stack, capped, _chat())).status_code == 200
        assert stack.decode.stats.requests[-1]["body"]["max_tokens"] == 20
        for explicit in ({"max_tokens": 40}, {"max_completion_tokens": 40}):
            assert (await _post(stack, stack.api_key, _chat(**explicit))).status_code == 200
            sent = stack.decode.stats.requests[-1]["body"]
            assert sent.get("max_tokens", sent.get("max_completion_tokens")) == 40
        # Completions keep OpenAI's own default of 16 tokens.
        async with httpx.AsyncClient(base_url=stack.base_url) as http:
            completion = await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "Once upon a time"},
                headers=stack.auth_headers,
            )
        assert completion.status_code == 200, completion.text
        assert "max_tokens" not in stack.decode.stats.requests[-1]["body"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_an_output_cap_beyond_the_context_window_is_400_naming_it(
    stack: FakeStack, field: str
) -> None:
    """Never a 429 (nothing the client waits for can make it fit) and no quota is reserved."""
    api_key = await stack.new_tenant("acme", tpm=100_000, rpm=100)
    refused = await _post(stack, api_key, _chat(**{field: 10_000_000}))
    assert refused.status_code == 400
    error = _error(refused)
    assert (error["code"], error["param"]) == ("max_tokens_too_large", field)
    assert "context window of 256 tokens" in error["message"]
    assert (await _usage(stack, "acme"))["requests"]["remaining"] == 100


async def test_unused_tokens_are_returned_after_the_request(quota_stack: FakeStack) -> None:
    stack = quota_stack
    tpm = 300  # refills 5 tokens/s: slow enough that a refund cannot pass for a refill
    api_key = await stack.new_tenant("acme", tpm=tpm)
    assert (await _usage(stack, "acme"))["tokens"]["remaining"] == tpm

    sent_at = time.monotonic()
    response = await _post(stack, api_key, _chat(max_tokens=200))
    assert response.status_code == 200
    reserved = QUESTION_TOKENS + 200
    assert response.headers["x-ratelimit-remaining-tokens"] == str(tpm - reserved)
    used = response.json()["usage"]["total_tokens"]
    assert used < 30, "the fake engine stops on its own after a few words"

    remaining = (await _usage(stack, "acme"))["tokens"]["remaining"]
    refilled = math.ceil((time.monotonic() - sent_at) * tpm / 60)
    # Charged exactly what the engine reported: the rest of the reservation came back.
    assert tpm - used <= remaining <= min(tpm, tpm - used + refilled)
    assert remaining > tpm - reserved + refilled, "no refund: only the refill came back"


# -- plan limits and concurrency -------------------------------------------------------------


async def test_plan_limits_per_request_are_400(stack: FakeStack) -> None:
    api_key = await stack.new_tenant("acme", max_prompt_tokens=20, max_output_tokens=8, rpm=100)
    long_prompt = await _post(stack, api_key, _chat("word " * 40, max_tokens=4))
    assert long_prompt.status_code == 400
    error = _error(long_prompt)
    assert (error["code"], error["param"]) == ("prompt_too_long", "messages")

    too_many = await _post(stack, api_key, _chat(max_tokens=9))
    assert too_many.status_code == 400
    error = _error(too_many)
    assert (error["code"], error["param"]) == ("max_tokens_too_large", "max_tokens")
    # Unset max_tokens is capped at the plan's limit, not refused: clients rarely set it.
    unset = await _post(stack, api_key, _chat())
    assert unset.status_code == 200
    assert stack.decode.stats.requests[-1]["body"]["max_tokens"] == 8
    async with stack.client_for(api_key) as client:
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=9)
        await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    # Refused before the quota: only the two requests that passed took a request unit.
    assert (await _usage(stack, "acme"))["requests"]["remaining"] == 98


async def test_max_concurrent_is_enforced(stack: FakeStack) -> None:
    api_key = await stack.new_tenant("acme", max_concurrent=1)
    stack.decode.token_delay_s = 0.1
    async with stack.client_for(api_key) as client:
        first = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=50, stream=True
        )
        async for _ in first:
            break
        refused = await _post(stack, api_key, _chat(max_tokens=4))
        assert refused.status_code == 429
        assert _error(refused)["code"] == "rate_limit_exceeded"
        assert "concurrent" in _error(refused)["message"]
        # A slot frees when a request of the tenant ends, not when a hold expires (minutes).
        assert refused.headers["retry-after"] == "1"
        assert (await _usage(stack, "acme"))["concurrent"] == 1

        stack.decode.token_delay_s = 0.0
        async for _ in first:
            pass
    await _settled(stack, "acme")
    assert (await _post(stack, api_key, _chat(max_tokens=4))).status_code == 200
    # The refused request never reached an engine.
    assert stack.decode.stats.num_requests == 2


async def test_a_client_leaving_mid_stream_settles_its_reservation(stack: FakeStack) -> None:
    tpm = 300
    api_key = await stack.new_tenant("acme", tpm=tpm, max_concurrent=1)
    stack.decode.token_delay_s = 0.1
    sent_at = time.monotonic()
    async with stack.client_for(api_key) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=200, stream=True
        )
        async for _ in stream:
            break
        assert (await _usage(stack, "acme"))["concurrent"] == 1
        await stream.close()

    await _settled(stack, "acme")
    await wait_until(lambda: stack.decode.stats.num_aborted == 1)
    # Charged the prompt and the few tokens streamed, not the 200 reserved.
    remaining = (await _usage(stack, "acme"))["tokens"]["remaining"]
    refilled = math.ceil((time.monotonic() - sent_at) * tpm / 60)
    assert remaining > tpm - (QUESTION_TOKENS + 200) + refilled
    assert remaining >= tpm - QUESTION_TOKENS - 20
    stack.decode.token_delay_s = 0.0
    assert (await _post(stack, api_key, _chat(max_tokens=4))).status_code == 200


# -- the fair queue --------------------------------------------------------------------------


async def test_a_queued_request_reports_its_queue_time(one_slot: FakeStack) -> None:
    stack = one_slot
    async with _holding_the_slot(stack):
        waiting = asyncio.create_task(_post(stack, stack.api_key, _chat(max_tokens=4)))
        await _wait_for_metric(stack, "tandem_admission_queued", 1)
        await asyncio.sleep(0.1)  # it waits at least this long
        stack.decode.token_delay_s = 0.0
    response = await waiting
    assert response.status_code == 200
    assert int(response.headers["x-tandem-queue-ms"]) >= 100
    assert await _metric(stack, "tandem_admission_queued") == 0


@pytest.mark.parametrize("http", [None, "h11"], ids=["gateway", "h11"])
async def test_a_client_leaving_the_queue_leaves_at_once(tmp_path: Path, http: str | None) -> None:
    # The gateway's own server signals the hang-up; another server is watched via receive().
    async with _one_slot_stack(tmp_path, http) as stack:
        api_key = await stack.new_tenant("waiter", tpm=120, max_concurrent=5)
        async with _holding_the_slot(stack):
            waiting = asyncio.create_task(_post(stack, api_key, _chat(max_tokens=50)))
            await _wait_for_metric(stack, "tandem_admission_queued", 1)
            usage = await _usage(stack, "waiter")
            assert (usage["queued_here"], usage["concurrent"]) == (1, 1)

            waiting.cancel()  # the client hangs up
            with pytest.raises(asyncio.CancelledError):
                await waiting
            # Out of the queue while the slot is still held: only the hang-up can have done it.
            await _wait_for_metric(stack, "tandem_admission_queued", 0)
            usage = await _usage(stack, "waiter")
            assert (usage["queued_here"], usage["concurrent"]) == (0, 0)
            # Full again: 65 tokens taken and not given back would need 30 s to refill at 2/s.
            assert usage["tokens"]["remaining"] == 120, "its reservation was refunded"
            stack.decode.token_delay_s = 0.0
        # It never reached an engine, even once the slot was free: a request sent now is served
        # next (had the hang-up stayed queued, it would have run first, being ahead in the queue).
        after = await _post(stack, api_key, _chat("after the slot freed", max_tokens=4))
        assert after.status_code == 200
        served = [
            request["body"]["messages"][0]["content"] for request in stack.decode.stats.requests
        ]
        assert served == [QUESTION_TEXT, "after the slot freed"]


async def test_a_full_queue_sheds_with_503_overloaded(tmp_path: Path) -> None:
    access = _access(tmp_path, max_in_flight_per_worker=1, max_queue=1)
    async with make_fake_stack(access=access) as stack:
        stack.decode.token_delay_s = 0.2
        api_key = await stack.new_tenant("late", tpm=120)
        async with _holding_the_slot(stack):
            queued = asyncio.create_task(_post(stack, stack.api_key, _chat(max_tokens=4)))
            await _wait_for_metric(stack, "tandem_admission_queued", 1)
            shed = await _post(stack, api_key, _chat(max_tokens=50))
            assert shed.status_code == 503
            error = _error(shed)
            assert (error["type"], error["code"]) == ("service_unavailable", "overloaded")
            assert 1 <= int(shed.headers["retry-after"]) <= 30
            usage = await _usage(stack, "late")
            assert usage["concurrent"] == 0
            assert usage["tokens"]["remaining"] == 120, "the shed request was refunded"
            stack.decode.token_delay_s = 0.0
        assert (await queued).status_code == 200


async def test_interactive_is_served_before_batch(one_slot: FakeStack) -> None:
    stack = one_slot
    bulk = await stack.new_tenant("bulk", band="batch")
    chat = await stack.new_tenant("chat", band="interactive")
    async with _holding_the_slot(stack):
        # Batch asks first, interactive second: both wait for the one slot.
        first = asyncio.create_task(_post(stack, bulk, _chat("from the batch tenant")))
        await _wait_for_metric(stack, "tandem_admission_queued", 1)
        second = asyncio.create_task(_post(stack, chat, _chat("from the interactive tenant")))
        await _wait_for_metric(stack, "tandem_admission_queued", 2)
        stack.decode.token_delay_s = 0.0
    responses = await asyncio.gather(first, second)
    assert [r.status_code for r in responses] == [200, 200]
    served = [request["body"]["messages"][0]["content"] for request in stack.decode.stats.requests]
    assert served[1:] == ["from the interactive tenant", "from the batch tenant"]
    bulk_wait = int(responses[0].headers["x-tandem-queue-ms"])
    chat_wait = int(responses[1].headers["x-tandem-queue-ms"])
    assert bulk_wait > chat_wait


async def test_a_client_leaving_during_the_reservation_gives_it_back(tmp_path: Path) -> None:
    """The client hangs up while the store is still answering its reservation: the store grants
    it late, and the gateway gives it back instead of leaving the hold taken for minutes."""
    with running_redis() as redis:
        access = _access(
            tmp_path,
            stores=StoreConfig(redis_url=redis.url, timeout_s=5),
            key_cache_ttl_s=60,  # authenticated from the cache while the store is frozen
        )
        async with make_fake_stack(access=access) as stack:
            api_key = await stack.new_tenant("acme", rpm=3, max_concurrent=1)
            assert (await _post(stack, api_key, _chat(max_tokens=4))).status_code == 200

            redis.pause()
            try:
                leaving = asyncio.create_task(_post(stack, api_key, _chat(max_tokens=4)))
                await asyncio.sleep(0.3)  # authenticated, its reservation sent and unanswered
                leaving.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leaving
                await asyncio.sleep(0.1)  # the gateway sees the hang-up while still waiting
            finally:
                redis.resume()

            usage = await _settled(stack, "acme")  # the late reservation's hold is given back
            # It was granted, then given back whole: no engine saw it, so its request unit too.
            assert usage["requests"]["remaining"] == 2
            assert (await _post(stack, api_key, _chat(max_tokens=4))).status_code == 200
            assert stack.decode.stats.num_requests == 2


# -- the quota store failing -----------------------------------------------------------------


@pytest.mark.parametrize("policy", [StoreFailurePolicy.OPEN, StoreFailurePolicy.CLOSED])
async def test_quota_store_outage_and_recovery(tmp_path: Path, policy: StoreFailurePolicy) -> None:
    with running_redis() as redis:
        access = _access(
            tmp_path,
            # A stopped server refuses connections at once: the timeout only bounds calls to
            # the restarted one. Its first (new connections, scripts loaded again) failed once
            # with 0.2 s (0.4 s a call) on a busy CI machine: a 503 creating a tenant.
            stores=StoreConfig(redis_url=redis.url, timeout_s=1.0),
            controller=ControllerConfig(store_failure=policy),
        )
        async with make_fake_stack(access=access) as stack:
            await _outage_and_recovery(stack, redis, policy)


async def _outage_and_recovery(
    stack: FakeStack, redis: RedisServer, policy: StoreFailurePolicy
) -> None:
    api_key = await stack.new_tenant("metered", rpm=1000, tpm=100_000)
    served = await _post(stack, api_key, _chat(max_tokens=4))  # the key is now known (cached)
    assert served.status_code == 200
    assert "x-ratelimit-remaining-requests" in served.headers

    # A stream admitted before the outage ends after it: the client still gets all of it, and
    # the reservation that could not be settled is counted.
    stack.decode.token_delay_s = 0.05
    async with stack.client_for(api_key) as client:
        stream = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=6, stream=True
        )
        async for _ in stream:
            break
        redis.stop()
        stack.decode.token_delay_s = 0.0
        rest = [chunk async for chunk in stream]
    assert rest[-1].choices[0].finish_reason == "length"
    # Settled once the response is over, which the client may see first.
    await _wait_for_metric(stack, "tandem_quota_store_errors_total", 1, operation="reconcile")

    during = await _post(stack, api_key, _chat(max_tokens=4))
    if policy is StoreFailurePolicy.OPEN:
        assert during.status_code == 200, during.text
        assert "x-ratelimit-remaining-requests" not in during.headers, "no quota was checked"
    else:
        assert during.status_code == 503, during.text
        error = _error(during)
        assert (error["type"], error["code"]) == ("service_unavailable", "store_unavailable")
        assert during.headers["retry-after"] == "2"
    assert await _metric(stack, "tandem_quota_store_errors_total", operation="reserve") == 1
    # Whatever the policy, an unknown key and the admin API answer 503, never 500.
    stranger = await _post(stack, "tdm-never-seen-before-0123456789", _chat(max_tokens=4))
    assert stranger.status_code == 503
    assert _error(stranger)["code"] == "store_unavailable"
    admin = await stack.admin.get("/admin/v1/tenants")
    assert admin.status_code == 503
    assert _error(admin)["code"] == "store_unavailable"

    # The server comes back empty (no persistence): quotas apply again at once, same gateway.
    redis.start()
    api_key = await stack.new_tenant("metered", rpm=1)
    served = await _post(stack, api_key, _chat(max_tokens=4))
    assert served.status_code == 200, served.text
    assert served.headers["x-ratelimit-remaining-requests"] == "0"
    refused = await _post(stack, api_key, _chat(max_tokens=4))
    assert refused.status_code == 429
    assert _error(refused)["code"] == "rate_limit_exceeded"


async def test_an_error_after_admission_keeps_the_request_and_ratelimit_headers(
    stack: FakeStack,
) -> None:
    api_key = await stack.new_tenant("acme", rpm=100, tpm=100_000)
    stack.decode.fail_status = 500  # every decode attempt fails: the client gets a 502
    response = await _post(stack, api_key, _chat(max_tokens=4))
    assert response.status_code == 502
    assert response.headers["x-request-id"]
    assert response.headers["x-ratelimit-limit-requests"] == "100"
    assert response.headers["x-ratelimit-limit-tokens"] == "100000"
