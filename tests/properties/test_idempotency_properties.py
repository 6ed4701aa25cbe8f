"""Property (issue 25): for any interleaving of duplicate requests, disconnects and expiries, an
engine runs at most once per key, and every replay equals the original.

**The stores** (``admission/idempotency.py``, ``admission/idempotency_redis.py``). Hypothesis
generates histories of claims (some of them concurrent duplicates), completions, releases,
lease renewals, forged or stale tokens and the passing of time, and plays each against the
in-memory store on a fake clock and against the Redis store on the session's real server, next to
a model of docs/WIRE.md §3 written from ``admission/idempotency.py``'s docstring. Every answer
must be the model's: so a key is claimed (its request runs) only when it is free, by one of any
number of concurrent duplicates, and a replay is byte for byte the response its owner stored.
Redis keeps time with its TTLs, on its own clock: its time passes by moving every TTL of the
test's keys back, and one model second is ten of its seconds, so the real milliseconds a
history takes never decide an expiry.

**The gateway** (``gateway/serving/idempotent.py``, ``gateway/serving/replay.py``): see the
second half of this file.

More examples: ``TANDEM_HYPOTHESIS_PROFILE=thorough`` (tests/properties/profiles.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import Phase, event, given, note, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from admission.idempotency import (
    Claimed,
    ClaimResult,
    IdempotencyStore,
    InProgress,
    MemoryIdempotencyStore,
    Mismatch,
    Replay,
    StoredResponse,
    fingerprint,
    retry_after_s,
    scope_key,
)
from admission.idempotency_redis import RedisIdempotencyStore
from tests.gateway.conftest import MODEL, FakeStack, make_fake_stack, wait_until
from tests.properties.profiles import examples
from tests.store_backends import delete_keys

NO_EXPLAIN = tuple(phase for phase in Phase if phase is not Phase.explain)
"""The explain phase replays a failing history hundreds of times to annotate a printout that
schemathesis's pytest plugin blanks anyway (it swaps hypothesis's printer for a silent one)."""

SCOPES = tuple(scope_key("acme", "chat", f"key-{n}") for n in range(3))
BODIES = tuple(
    fingerprint({"model": "m", "messages": [{"role": "user", "content": text}]})
    for text in ("hi", "bye")
)
RESPONSES = (
    StoredResponse(200, b'{"id":"chatcmpl-1","choices":[]}', 1.7e9 + 0.125),
    StoredResponse(200, bytes(range(256)), 1.7e9 + 1),  # any bytes come back as they went
    StoredResponse(502, b'{"error":{"code":"engine_error"}}', 1.7e9 + 2.5),
)
FORGED = "0" * 32
"""A token no claim was given."""


# -- the steps of a store history ---------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    scope: int
    body: int
    lease: int
    duplicates: int
    """How many claims of this scope and body run at once (1: alone)."""


@dataclass(frozen=True)
class Complete:
    claim: int
    """Which claim's token: an index into the claims granted, modulo their number (-1: the
    latest); none granted yet: a forged one."""
    response: int
    retention: int


@dataclass(frozen=True)
class Release:
    claim: int


@dataclass(frozen=True)
class Extend:
    claim: int
    lease: int


@dataclass(frozen=True)
class Advance:
    seconds: int


StoreStep = Claim | Complete | Release | Extend | Advance

durations = st.integers(1, 30)
# Mostly the latest claims (their keys are the live ones), sometimes an old, stale token.
claim_refs = st.sampled_from((-1, -1, -1, -2, 0, 1, 2))
claims = st.builds(
    Claim, st.integers(0, len(SCOPES) - 1), st.integers(0, 1), durations,
    st.sampled_from((1, 1, 2, 5)),
)  # fmt: skip
completes = st.builds(Complete, claim_refs, st.integers(0, len(RESPONSES) - 1), st.integers(1, 20))


def weighted(*choices: tuple[int, st.SearchStrategy[StoreStep]]) -> st.SearchStrategy[StoreStep]:
    """Each strategy drawn in proportion to its weight (``st.one_of`` merges repeated ones)."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


store_steps = weighted(  # claims and completions more often: keys live long enough to meet
    (2, claims),
    (2, completes),
    (1, st.builds(Release, claim_refs)),
    (1, st.builds(Extend, claim_refs, durations)),
    (1, st.builds(Advance, st.integers(1, 8))),
)
store_histories = st.lists(store_steps, min_size=8, max_size=30).map(tuple)
capped_histories = st.lists(  # claims of new keys more often still: they fill the cap
    weighted((1, claims), (2, store_steps)), min_size=8, max_size=30
).map(tuple)


# -- the model ----------------------------------------------------------------------------------


@dataclass
class Record:
    fingerprint: str
    expires_at: int
    token: str | None
    """The running claim's owner; None once completed."""
    response: StoredResponse | None = None


@dataclass
class Model:
    """docs/WIRE.md §3 in a dictionary, on integer seconds."""

    max_entries: int | None = None
    """The memory store's cap (``MemoryIdempotencyStore(max_entries=...)``); Redis has none."""
    now: int = 0
    records: dict[str, Record] = field(default_factory=dict)
    """In claim order (the cap evicts the oldest claim when no record is completed)."""
    completed: list[str] = field(default_factory=list)
    """Completed scopes, oldest completion first (the cap evicts them first)."""

    def live(self, scope: str) -> Record | None:
        record = self.records.get(scope)
        if record is not None and record.expires_at <= self.now:
            self.drop(scope)
            return None
        return record

    def drop(self, scope: str) -> None:
        del self.records[scope]
        if scope in self.completed:
            self.completed.remove(scope)

    def owned(self, scope: str, token: str) -> Record | None:
        record = self.live(scope)
        return record if record is not None and record.token == token else None

    def claim(self, scope: str, body: str, lease: int, token: str | None) -> type[ClaimResult]:
        """What a claim must answer; ``token``: the one the store gave, if it said Claimed."""
        record = self.live(scope)
        if record is None:
            assert token is not None, "the key is free, yet the claim was refused"
            if self.max_entries is not None:
                for other in list(self.records):  # what expired goes first
                    self.live(other)
                while len(self.records) >= self.max_entries:
                    event(f"the cap evicted a {'completed' if self.completed else 'running'} key")
                    self.drop(self.completed[0] if self.completed else next(iter(self.records)))
            self.records[scope] = Record(body, self.now + lease, token)
            return Claimed
        if record.fingerprint != body:
            return Mismatch
        return Replay if record.response is not None else InProgress

    def complete(self, scope: str, token: str, response: StoredResponse, retention: int) -> bool:
        record = self.owned(scope, token)
        if record is None:
            return False
        record.token, record.response = None, response
        record.expires_at = self.now + retention
        self.completed.append(scope)
        return True

    def release(self, scope: str, token: str) -> None:
        if self.owned(scope, token) is not None:
            self.drop(scope)

    def extend(self, scope: str, token: str, lease: int) -> bool:
        record = self.owned(scope, token)
        if record is None:
            return False
        record.expires_at = self.now + lease
        return True


# -- playing a store history --------------------------------------------------------------------


@dataclass
class StorePlayer:
    store: IdempotencyStore
    second_s: float
    """Store seconds per model second."""
    advance: Callable[[int], Awaitable[None]]
    """Let that many model seconds pass for the store."""
    retry_after_tolerance_s: float
    model: Model
    granted: list[tuple[str, str]] = field(default_factory=list)
    """(scope, token) of every claim granted, in order."""

    def token(self, ref: int) -> tuple[str, str]:
        return self.granted[ref % len(self.granted)] if self.granted else (SCOPES[0], FORGED)

    async def play(self, step: StoreStep) -> None:
        model = self.model
        match step:
            case Claim(scope_index, body_index, lease, duplicates):
                scope, body = SCOPES[scope_index], BODIES[body_index]
                answers = await asyncio.gather(
                    *(
                        self.store.claim(scope, body, lease * self.second_s)
                        for _ in range(duplicates)
                    )
                )
                self.check_claims(scope, body, lease, list(answers))
            case Complete(ref, response_index, retention):
                scope, token = self.token(ref)
                response = RESPONSES[response_index]
                stored = await self.store.complete(
                    scope, token, response, retention * self.second_s
                )
                assert stored == model.complete(scope, token, response, retention), step
            case Release(ref):
                scope, token = self.token(ref)
                await self.store.release(scope, token)
                model.release(scope, token)
            case Extend(ref, lease):
                scope, token = self.token(ref)
                renewed = await self.store.extend(scope, token, lease * self.second_s)
                assert renewed == model.extend(scope, token, lease), step
            case Advance(seconds):
                model.now += seconds
                await self.advance(seconds)

    def check_claims(self, scope: str, body: str, lease: int, answers: list[ClaimResult]) -> None:
        """Duplicates at once answer as if one after the other: one winner at most."""
        winners = [answer for answer in answers if isinstance(answer, Claimed)]
        assert len(winners) <= 1, f"{len(winners)} concurrent claims of one key won: it ran twice"
        token = winners[0].token if winners else None
        expected = [self.model.claim(scope, body, lease, token)]
        expected += [self.model.claim(scope, body, lease, None) for _ in answers[1:]]
        assert sorted(type(a).__name__ for a in answers) == sorted(e.__name__ for e in expected)
        if token is not None:
            self.granted.append((scope, token))
        record = self.model.records[scope]
        for answer in answers:
            if isinstance(answer, Replay):
                assert answer.response == record.response, "a replay differs from the original"
            if isinstance(answer, InProgress):
                left_s = (record.expires_at - self.model.now) * self.second_s
                expected_s = retry_after_s(left_s)
                assert abs(answer.retry_after_s - expected_s) <= self.retry_after_tolerance_s


async def play_store(history: tuple[StoreStep, ...], player: StorePlayer) -> None:
    note(repr(history))  # schemathesis's pytest plugin blanks hypothesis's own printout
    try:
        for step in history:
            await player.play(step)
    finally:
        await player.store.aclose()


def play_memory(history: tuple[StoreStep, ...], max_entries: int | None) -> None:
    now = [0.0]
    store = MemoryIdempotencyStore(clock=lambda: now[0], max_entries=max_entries or 100_000)

    async def advance(seconds: int) -> None:
        now[0] += seconds

    model = Model(max_entries)
    asyncio.run(play_store(history, StorePlayer(store, 1.0, advance, 0.0, model)))


@settings(max_examples=examples(150), phases=NO_EXPLAIN)
@given(history=store_histories)
def test_memory_store_follows_the_model(history: tuple[StoreStep, ...]) -> None:
    play_memory(history, None)


@settings(max_examples=examples(150), phases=NO_EXPLAIN)
@given(history=capped_histories, max_entries=st.sampled_from((1, 2)))
def test_memory_store_at_its_cap_follows_the_model(
    history: tuple[StoreStep, ...], max_entries: int
) -> None:
    """At one or two records, each claim of a new key evicts another key's record: the oldest
    completed one, else the oldest claim (whose owner then loses it)."""
    play_memory(history, max_entries)


REDIS_SECOND_S = 10.0


@settings(max_examples=examples(100), phases=NO_EXPLAIN)
@given(history=store_histories)
def test_redis_store_follows_the_model(history: tuple[StoreStep, ...], redis_url: str) -> None:
    prefix = f"prop:{uuid.uuid4().hex}:"

    async def run() -> None:
        raw = Redis.from_url(redis_url)

        async def advance(seconds: int) -> None:
            """Redis's time passes for this test's keys: every TTL moves back, and what
            reaches zero is gone (the store reads no other clock)."""
            elapsed_ms = round(seconds * REDIS_SECOND_S * 1000)
            async for key in raw.scan_iter(match=f"{prefix}*"):
                left_ms = await raw.pttl(key)
                if left_ms <= elapsed_ms:
                    await raw.delete(key)
                else:
                    await raw.pexpire(key, left_ms - elapsed_ms)

        store = RedisIdempotencyStore(redis_url, prefix=prefix)
        try:
            # InProgress's retry_after is the PTTL: real milliseconds may have gone by.
            await play_store(history, StorePlayer(store, REDIS_SECOND_S, advance, 0.5, Model()))
        finally:
            await raw.aclose()
            await delete_keys(redis_url, prefix)

    asyncio.run(run())


# -- the gateway --------------------------------------------------------------------------------
#
# The same property end to end: the gateway on a real uvicorn server over fake engines
# (tests/gateway/conftest.py), raw HTTP so headers and bytes are seen as sent. Each example has
# two fresh keys; each key's requests carry a marker of their own, so the fake engines' request
# logs count the runs of each key. The in-memory store runs on a clock the test moves.
#
#     Send      one request: the key's body or another one, JSON or a stream (with or without
#               the usage chunk); the engine may fail it before its first byte or mid-stream
#     Together  2-4 requests of one key at once (JSON and streams, either body) on a slow engine
#     Leave     a stream whose client hangs up after n events, on a slow engine
#     Expire    every run ends, then the clock passes the retention: the keys are free again
#
# An epoch is a key's life between two expiries. Per epoch: exactly one request is the original
# and the engines ran it once (one prefill leg; one decode leg, or two when it failed before its
# first byte: its one colocated re-run, docs/ARCHITECTURE.md "Paths"); every other request is
# a replay, a 409 (same body, while it runs) or a 422 (the other body); one sent after the
# original's client heard the end is never a 409. The epoch ends with retries (streams, then
# JSON) which must replay the stored answer, and every answer of the epoch is that answer: a
# JSON original or replay byte for byte; an error (before the first byte, or the original's
# mid-stream error event) byte for byte; a stream (the original, or a replay) says the same id,
# created, text, finish reason and usage (when asked), and replayed streams are byte for byte
# each other; a client that left saw a beginning of it.

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
    note(repr(history))
    stack, store = clocked_gateway
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers=stack.auth_headers, timeout=15
    ) as http:
        player = GatewayPlayer(stack, store, http)
        for step in history:
            await player.play(step)
        await player.end_epochs()
