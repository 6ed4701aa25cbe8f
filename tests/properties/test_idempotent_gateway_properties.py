"""Property (issue 25), end to end: for any interleaving of duplicate requests, disconnects,
engine errors and expiries, the gateway runs a key's request at most once, and every replay
equals the original (``gateway/serving/idempotent.py``, ``gateway/serving/replay.py``; the
stores alone: tests/properties/test_idempotency_properties.py).

The gateway runs on a real uvicorn server over fake engines (tests/gateway/conftest.py) and is
called over raw HTTP, so headers and bytes are seen as sent. Each example has two fresh keys;
each key's requests carry a marker of their own, so the fake engines' request logs count the
runs of each key. The in-memory idempotency store runs on a clock the test moves. The steps:

    Send      one request: the key's body or another one, JSON or a stream (with or without
              the usage chunk); the engine may fail it before its first byte or mid-stream
    Together  2-4 requests of one key at once (JSON and streams, either body) on a slow engine
    Leave     a stream whose client hangs up after n events, on a slow engine
    Expire    every run ends, then the clock passes the retention: the keys are free again

An epoch is a key's life between two expiries. Per epoch: exactly one request is the original
and the engines ran it once (one prefill leg; one decode leg, or two when it failed before its
first byte: its one colocated re-run, docs/ARCHITECTURE.md "Paths"); every other request is a
replay, a 409 (same body, while it runs) or a 422 (the other body); one sent after the
original's client heard the end is never a 409. The epoch ends with retries (streams, then
JSON) which must replay the stored answer, and every answer of the epoch is that answer: a JSON
original or replay byte for byte; an error (before the first byte, or the original's mid-stream
error event) byte for byte; a stream (the original, or a replay) says the same id, created,
text, finish reason and usage (when asked), and replayed streams are byte for byte each other;
a client that left saw a beginning of it.

More examples: ``TANDEM_HYPOTHESIS_PROFILE=thorough`` (tests/properties/profiles.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from admission.idempotency import Claimed, ClaimResult, MemoryIdempotencyStore, StoredResponse
from tests.gateway.conftest import MODEL, FakeStack, make_fake_stack, wait_until
from tests.properties.drawing import NO_EXPLAIN
from tests.properties.profiles import examples

KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "idempotent-replayed"
CHAT = "/v1/chat/completions"
NUM_KEYS = 2
SLOW_TOKEN_S = 0.02
"""The decode engine's delay per token during Together and Leave (about 0.2 s an answer), so
duplicates overlap the run and a client can leave in the middle."""
EXPIRY_S = 10 * 86_400.0
"""Past the retention (24 h) and any lease (a deadline plus a minute)."""
SETTLE_S = 15.0


class Fault(enum.Enum):
    FAIL = "the decode engine answers 500 (and so does the colocated re-run)"
    MID_STREAM = "the decode engine sends an error event after 3 tokens"


@dataclass(frozen=True)
class Request:
    other_body: bool
    stream: bool
    include_usage: bool = False


@dataclass(frozen=True)
class Send:
    key: int
    request: Request
    fault: Fault | None


@dataclass(frozen=True)
class Together:
    key: int
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Leave:
    key: int
    after_events: int


@dataclass(frozen=True)
class Expire:
    pass


GatewayStep = Send | Together | Leave | Expire

key_refs = st.integers(0, NUM_KEYS - 1)
requests = st.builds(Request, st.booleans(), st.booleans(), st.booleans())
gateway_steps = st.one_of(
    st.builds(Send, key_refs, requests, st.sampled_from((None,) * 4 + tuple(Fault))),
    st.builds(Together, key_refs, st.lists(requests, min_size=2, max_size=4).map(tuple)),
    st.builds(Leave, key_refs, st.integers(0, 3)),
    st.just(Expire()),
)
gateway_histories = st.lists(gateway_steps, min_size=1, max_size=8).map(tuple)


class ClockedStore(MemoryIdempotencyStore):
    """The gateway's in-memory store on a clock the test moves; it also knows which claims
    are still running (claimed, neither completed nor released)."""

    def __init__(self) -> None:
        self.now = 0.0
        super().__init__(clock=lambda: self.now)
        self.running: set[tuple[str, str]] = set()

    async def claim(self, scope: str, fingerprint: str, lease_s: float) -> ClaimResult:
        outcome = await super().claim(scope, fingerprint, lease_s)
        if isinstance(outcome, Claimed):
            self.running.add((scope, outcome.token))
        return outcome

    async def complete(
        self, scope: str, token: str, response: StoredResponse, retention_s: float
    ) -> bool:
        self.running.discard((scope, token))
        return await super().complete(scope, token, response, retention_s)

    async def release(self, scope: str, token: str) -> None:
        self.running.discard((scope, token))
        await super().release(scope, token)


@dataclass
class Seen:
    """One request as its client saw it."""

    request: Request
    status: int
    replayed: bool
    body: bytes = b""
    """The JSON body (an error's too, streamed or not); empty for a 200 stream."""
    events: list[bytes] = field(default_factory=list)
    """A 200 stream's ``data:`` payloads as they came, without ``[DONE]``."""
    done: bool = False
    """The stream's last event was ``[DONE]``."""
    heard_the_end: bool = False
    """The client read the answer to its end (it did not hang up)."""

    @property
    def original(self) -> bool:
        """Its request ran (an engine error is an answer too)."""
        return not self.replayed and self.status not in (409, 422)

    def error_code(self) -> str:
        error: dict[str, str] = orjson.loads(self.body)["error"]
        return error["code"]


@dataclass(frozen=True)
class Answer:
    """What a successful answer says, read without the gateway's own assembler."""

    id: str
    created: int
    text: str
    finish_reason: str | None
    usage: dict[str, Any] | None


def answer_of_json(body: dict[str, Any]) -> Answer:
    choice = body["choices"][0]
    return Answer(
        body["id"], body["created"], choice["message"]["content"] or "", choice["finish_reason"],
        body.get("usage"),
    )  # fmt: skip


def answer_of_events(events: list[bytes]) -> Answer:
    chunks = [orjson.loads(event) for event in events]
    assert len({chunk["id"] for chunk in chunks}) == 1, "one stream, one id"
    assert len({chunk["created"] for chunk in chunks}) == 1, "one stream, one created"
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    assert {choice["index"] for choice in choices} <= {0}
    usages = [chunk["usage"] for chunk in chunks if not chunk["choices"]]
    assert len(usages) <= 1
    finish = [choice["finish_reason"] for choice in choices if choice.get("finish_reason")]
    return Answer(
        chunks[0]["id"],
        chunks[0]["created"],
        "".join(choice["delta"].get("content") or "" for choice in choices),
        finish[-1] if finish else None,
        usages[0] if usages else None,
    )


@dataclass
class KeyLife:
    """One key of an example: what its clients saw in the current epoch."""

    key: str
    marker: str
    runs_before: tuple[int, int]
    """(prefill, decode) requests carrying the marker when the epoch began."""
    seen: list[Seen] = field(default_factory=list)
    """The epoch's requests, in the order they were sent (concurrent ones in any order)."""
    heard_the_end: bool = False
    """The epoch's original was answered to its end: no later request may be a 409."""

    def body(self, request: Request) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Tell me a story about {self.marker}"}],
            "max_tokens": 31 if request.other_body else 32,  # another fingerprint
        }
        if request.stream:
            body["stream"] = True
            if request.include_usage:
                body["stream_options"] = {"include_usage": True}
        return body


class GatewayPlayer:
    """Plays a history against the gateway and checks each key's epochs as they end."""

    def __init__(self, stack: FakeStack, store: ClockedStore, http: httpx.AsyncClient) -> None:
        self._stack = stack
        self._store = store
        self._http = http
        self.keys: list[KeyLife] = []
        for _ in range(NUM_KEYS):
            marker = f"marker-{uuid.uuid4().hex[:12]}"
            self.keys.append(KeyLife(f"key-{uuid.uuid4().hex}", marker, self.runs(marker)))

    def runs(self, marker: str) -> tuple[int, int]:
        """Requests carrying ``marker`` that the (prefill, decode) engines received."""
        prefill, decode = (
            sum(marker in orjson.dumps(seen["body"]).decode() for seen in engine.stats.requests)
            for engine in (self._stack.prefill, self._stack.decode)
        )
        return prefill, decode

    async def play(self, step: GatewayStep) -> None:
        decode = self._stack.decode
        match step:
            case Send(ref, request, fault):
                life = self.keys[ref]
                heard_before = life.heard_the_end
                decode.fail_status = 500 if fault is Fault.FAIL else None
                decode.error_after_tokens = 3 if fault is Fault.MID_STREAM else None
                try:
                    seen = await self.send(life, request)
                finally:
                    decode.fail_status = decode.error_after_tokens = None
                assert not (heard_before and seen.status == 409), "409 after the end was heard"
                life.heard_the_end |= seen.original and seen.heard_the_end
            case Together(ref, requests):
                life = self.keys[ref]
                decode.token_delay_s = SLOW_TOKEN_S
                try:
                    seen_all = await asyncio.gather(*(self.send(life, r) for r in requests))
                finally:
                    decode.token_delay_s = 0.0
                life.heard_the_end |= any(s.original and s.heard_the_end for s in seen_all)
            case Leave(ref, after_events):
                decode.token_delay_s = SLOW_TOKEN_S
                try:
                    await self.send(self.keys[ref], Request(False, True), leave_after=after_events)
                finally:
                    decode.token_delay_s = 0.0
            case Expire():
                await self.end_epochs()
                self._store.now += EXPIRY_S

    async def send(self, life: KeyLife, request: Request, leave_after: int | None = None) -> Seen:
        """One request with the key; ``leave_after``: hang up after that many events."""
        headers = {KEY_HEADER: life.key}
        async with self._http.stream(
            "POST", CHAT, json=life.body(request), headers=headers
        ) as response:
            replayed = response.headers.get(REPLAYED_HEADER) == "true"
            seen = Seen(request, response.status_code, replayed)
            life.seen.append(seen)
            if not request.stream or response.status_code != 200:
                seen.body = await response.aread()
                seen.heard_the_end = True
                return seen
            assert response.headers["content-type"].startswith("text/event-stream")
            async for line in response.aiter_lines():
                if leave_after is not None and len(seen.events) >= leave_after:
                    return seen  # the client hangs up
                if line == "data: [DONE]":
                    seen.done = True
                elif line.startswith("data: "):
                    seen.events.append(line[6:].encode())
            seen.heard_the_end = True
        return seen

    async def end_epochs(self) -> None:
        """Every run ends; each key that was used replays its answer to retries: streams with
        and without usage, then JSON (the epoch's last request)."""
        await wait_until(lambda: not self._store.running, timeout_s=SETTLE_S)
        for life in self.keys:
            originals = [seen for seen in life.seen if seen.original]
            if originals:
                other = originals[0].request.other_body
                for retry in (Request(other, True, False), Request(other, True, True)):
                    await self.send(life, retry)
                await self.send(life, Request(other, False))
            check_epoch(life, self.runs(life.marker))
            life.seen, life.heard_the_end = [], False
            life.runs_before = self.runs(life.marker)


def check_epoch(life: KeyLife, runs: tuple[int, int]) -> None:
    prefill_legs, decode_legs = (
        now - before for now, before in zip(runs, life.runs_before, strict=True)
    )
    if not life.seen:
        assert (prefill_legs, decode_legs) == (0, 0)
        return
    originals = [seen for seen in life.seen if seen.original]
    assert len(originals) == 1, f"{len(originals)} requests of one key ran in one epoch"
    original, retry = originals[0], life.seen[-1]
    failed_before_first_byte = original.status >= 500
    assert (prefill_legs, decode_legs) == (1, 1 + failed_before_first_byte), (
        f"the engines ran one key's request {prefill_legs} and {decode_legs} times in one epoch"
    )
    for seen in life.seen:
        if seen.request.other_body != original.request.other_body:
            assert seen.status == 422 and seen.error_code() == "idempotency_key_reused", seen
        elif seen.status == 409:
            assert seen.error_code() == "idempotency_key_in_use", seen
    assert retry.replayed and not retry.request.stream, "the retry after the end replays"
    answered = [seen for seen in life.seen if seen.status not in (409, 422)]
    if retry.status != 200:
        check_error_epoch(original, retry, answered)
    else:
        check_answer_epoch(retry, answered)
    note_epoch(life, original)


def check_error_epoch(original: Seen, retry: Seen, answered: list[Seen]) -> None:
    """The engine failed the original: every answer is its error, byte for byte."""
    assert set(orjson.loads(retry.body)) == {"error"} and retry.status == 502, retry
    for seen in answered:
        if seen is original and seen.status == 200:  # committed: the error was its last event
            assert seen.events[-1] == retry.body and not seen.done, seen
        else:
            assert (seen.status, seen.body) == (retry.status, retry.body), seen


def check_answer_epoch(retry: Seen, answered: list[Seen]) -> None:
    """The original succeeded: every answer is the stored one."""
    stored = answer_of_json(orjson.loads(retry.body))
    assert stored.text and stored.finish_reason == "stop" and stored.usage, stored
    replayed_streams: dict[bool, list[bytes]] = {}
    for seen in answered:
        assert seen.status == 200, seen
        if not seen.request.stream:
            assert seen.body == retry.body, "a JSON answer differs from the stored one"
            continue
        if not seen.heard_the_end:  # the client left: it saw a beginning of the answer
            if seen.events:
                answer = answer_of_events(seen.events)
                assert (answer.id, answer.created) == (stored.id, stored.created)
                assert stored.text.startswith(answer.text)
            continue
        assert seen.done, "a stream that ended without [DONE]"
        usage = stored.usage if seen.request.include_usage else None
        answer = answer_of_events(seen.events)
        assert answer == dataclasses.replace(stored, usage=usage), "a stream differs"
        if seen.replayed:
            first = replayed_streams.setdefault(seen.request.include_usage, seen.events)
            assert seen.events == first, "two replayed streams differ"


def note_epoch(life: KeyLife, original: Seen) -> None:
    """What the epoch exercised (``--hypothesis-show-statistics`` shows how often)."""
    if not original.heard_the_end:
        event("the original's client left mid-stream")
    if original.status != 200 or (original.heard_the_end and not original.done):
        event("the original failed")
    for status in sorted({seen.status for seen in life.seen} - {200}):
        event(f"an epoch saw a {status}")
    if any(seen.replayed and seen.request.stream for seen in life.seen):
        event("a replay was streamed")


@pytest.fixture(scope="module")
async def clocked_gateway() -> AsyncIterator[tuple[FakeStack, ClockedStore]]:
    """One gateway for every example (each has keys and markers of its own) whose in-memory
    idempotency store runs on the test's clock."""
    store = ClockedStore()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.assembly.stores.MemoryIdempotencyStore", lambda: store)
        async with make_fake_stack() as stack:
            yield stack, store


@settings(max_examples=examples(20), phases=NO_EXPLAIN)
@given(history=gateway_histories)
async def test_the_gateway_runs_a_key_once_and_replays_the_original(
    history: tuple[GatewayStep, ...], clocked_gateway: tuple[FakeStack, ClockedStore]
) -> None:
    note(repr(history))  # see NO_EXPLAIN
    stack, store = clocked_gateway
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers=stack.auth_headers, timeout=15
    ) as http:
        player = GatewayPlayer(stack, store, http)
        for step in history:
            await player.play(step)
        await player.end_epochs()
