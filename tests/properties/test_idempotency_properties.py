"""Property (issue 25): for any interleaving of duplicate requests, disconnects and expiries, an
engine runs at most once per key, and every replay equals the original. Here, the idempotency
stores (``admission/idempotency.py``, ``admission/idempotency_redis.py``); end to end through
the gateway: tests/properties/test_idempotent_gateway_properties.py.

Hypothesis generates histories of claims (some of them concurrent duplicates), completions,
releases, lease renewals, forged or stale tokens and the passing of time, and plays each against
the in-memory store on a fake clock (also at a cap on its records) and against the Redis store
on the session's real server, next to a model of docs/WIRE.md §3 written from
``admission/idempotency.py``'s docstring. Every answer must be the model's: so a key is claimed
(its request runs) only when it is free, by one of any number of concurrent duplicates, and a
replay is byte for byte the response its owner stored. Redis keeps time with its TTLs, on its
own clock: its time passes by moving every TTL of the test's keys back, and one model second is
ten of its seconds, so the real milliseconds a history takes never decide an expiry.

More examples: ``TANDEM_HYPOTHESIS_PROFILE=thorough`` (tests/properties/profiles.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hypothesis import event, given, note, settings
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
from tests.properties.drawing import NO_EXPLAIN, weighted
from tests.properties.profiles import examples
from tests.store_backends import delete_keys

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
    note(repr(history))  # see NO_EXPLAIN
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
