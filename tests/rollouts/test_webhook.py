"""rollouts.webhook against a real HTTP receiver (aiohttp on 127.0.0.1): deliveries arrive signed
and ``verify`` accepts them while a tampered body, a wrong secret or a stale timestamp fail; a
receiver failing twice is retried and delivered; one always failing ends ``failed`` after
``attempts``; a full queue drops and counts; one rollout's events arrive in order while another
rollout's are not held up; ``send`` neither waits nor raises."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from rollouts.webhook import (
    SIGNATURE_HEADER,
    Webhook,
    WebhookEvent,
    WebhookSender,
    sign,
    verify,
)
from tests.http_app import served

SECRET = "whsec_test"
NOW = 1_700_000_000.0


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.body)
        return parsed


@dataclass
class Receiver:
    """Records every request; answers the scripted statuses in turn, then 200. ``gate``: each
    request waits for it; ``delay``: seconds to wait before answering, from the parsed body."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    statuses: deque[int] = field(default_factory=deque)
    gate: asyncio.Event | None = None
    delay: Callable[[dict[str, Any]], float] | None = None
    answer: Callable[[dict[str, Any]], int | None] | None = None
    """A status for this body, or None for the scripted ones."""

    async def handle(self, request: web.Request) -> web.Response:
        received = Received(
            {key.lower(): value for key, value in request.headers.items()}, await request.read()
        )
        self.requests.append(received)
        if self.gate is not None:
            await self.gate.wait()
        if self.delay is not None:
            await asyncio.sleep(self.delay(received.json))
        status = None if self.answer is None else self.answer(received.json)
        if status is None:
            status = self.statuses.popleft() if self.statuses else 200
        return web.Response(status=status)

    def events(self, rollout_id: str) -> list[Any]:
        """The ``n`` of each request of ``rollout_id``'s events, as they arrived."""
        return [r.json["data"]["n"] for r in self.requests if r.json["rollout_id"] == rollout_id]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    async with served(app) as base_url:
        receiver.url = f"{base_url}/hook"
        yield receiver
        if receiver.gate is not None:
            receiver.gate.set()


@pytest.fixture
async def senders() -> AsyncIterator[list[WebhookSender]]:
    """Senders a test makes; each is closed afterwards."""
    made: list[WebhookSender] = []
    yield made
    for sender in made:
        await sender.aclose(timeout_s=0.1)


@pytest.fixture
def make_sender(senders: list[WebhookSender]) -> Callable[..., WebhookSender]:
    def make(**kwargs: Any) -> WebhookSender:
        kwargs.setdefault("backoff_s", 0.01)
        sender = WebhookSender(**kwargs)
        senders.append(sender)
        return sender

    return make


_ids = itertools.count()


def event(name: str = "started", rollout_id: str = "r1", **data: Any) -> WebhookEvent:
    return WebhookEvent(
        event=name,
        rollout_id=rollout_id,
        alias="chat",
        at=NOW,
        data=data,
        delivery_id=f"d{next(_ids)}",
    )


def ticking(start: float = NOW) -> Callable[[], float]:
    """A clock one second further on each call."""
    ticks: Iterator[int] = itertools.count()
    return lambda: start + next(ticks)


async def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``condition`` (the sender counts, which have no event to wait on) or fail."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def test_deliveries_arrive_signed_and_verify_accepts_them(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    sender = make_sender(clock=lambda: NOW)
    sent = event("step_passed", weight=25.0)
    assert sender.send(Webhook(receiver.url, SECRET), sent)
    await sender.flush()

    assert (sender.delivered, sender.failed, sender.dropped) == (1, 0, 0)
    [got] = receiver.requests
    assert got.headers["content-type"] == "application/json"
    assert got.headers["x-tandem-event"] == "step_passed"
    assert got.headers["x-tandem-delivery"] == sent.delivery_id
    assert got.body == sent.to_body()
    assert got.json == {
        "id": sent.delivery_id,
        "event": "step_passed",
        "rollout_id": "r1",
        "alias": "chat",
        "at": NOW,
        "data": {"weight": 25.0},
    }
    header = got.headers[SIGNATURE_HEADER]
    assert header.startswith(f"t={int(NOW)},v1=")
    assert verify(SECRET, header, got.body, now=NOW + 10)


async def test_verify_rejects_tampering_wrong_secrets_and_stale_timestamps(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    sender = make_sender(clock=lambda: NOW)
    sender.send(Webhook(receiver.url, SECRET), event("failed", gate="ttft_p95"))
    await sender.flush()
    [got] = receiver.requests
    header, body = got.headers[SIGNATURE_HEADER], got.body

    assert verify(SECRET, header, body, now=NOW + 300)
    assert verify(SECRET, header, body, now=NOW - 300)
    assert not verify(SECRET, header, body.replace(b"ttft_p95", b"itl_p95"), now=NOW)
    assert not verify(SECRET, header, body + b" ", now=NOW)
    assert not verify("whsec_other", header, body, now=NOW)
    assert not verify(SECRET, header, body, now=NOW + 301)
    assert not verify(SECRET, header, body, now=NOW + 60, tolerance_s=30)
    # A captured signature replayed under a fresh timestamp: the timestamp is inside the MAC.
    mac = header.split("v1=")[1]
    assert not verify(SECRET, f"t={int(NOW) + 1000},v1={mac}", body, now=NOW + 1000)


def test_the_signature_is_hmac_sha256_of_timestamp_dot_body() -> None:
    body = b'{"a":1}'
    mac = hmac.new(b"s3cret", b"1700000000." + body, hashlib.sha256).hexdigest()
    assert sign("s3cret", 1_700_000_000, body) == f"t=1700000000,v1={mac}"
    # A rotated secret: any one v1 matching is enough.
    assert verify("s3cret", f"t=1700000000,v1={'0' * 64},v1={mac}", body, now=NOW)


@pytest.mark.parametrize(
    "header",
    ["", "garbage", "t=abc,v1=00", f"v1={'0' * 64}", "t=1700000000", "t=1700000000,v1"],
)
def test_verify_says_false_to_malformed_headers(header: str) -> None:
    assert verify(SECRET, header, b"{}", now=NOW) is False


async def test_a_receiver_failing_twice_is_retried_and_delivered(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    receiver.statuses.extend([500, 500])
    sender = make_sender(attempts=4, clock=ticking())
    sent = event("promoted")
    sender.send(Webhook(receiver.url, SECRET), sent)
    await sender.flush()

    assert (sender.delivered, sender.failed, sender.dropped) == (1, 0, 0)
    assert len(receiver.requests) == 3
    assert {r.headers["x-tandem-delivery"] for r in receiver.requests} == {sent.delivery_id}
    assert {r.body for r in receiver.requests} == {sent.to_body()}
    # Each attempt is signed anew, at its own time, and each signature verifies.
    stamps = [r.headers[SIGNATURE_HEADER].split(",")[0] for r in receiver.requests]
    assert stamps == [f"t={int(NOW) + i}" for i in range(3)]
    for r in receiver.requests:
        assert verify(SECRET, r.headers[SIGNATURE_HEADER], r.body, now=NOW)


async def test_a_receiver_always_failing_ends_failed_after_every_attempt(
    receiver: Receiver,
    make_sender: Callable[..., WebhookSender],
    caplog: pytest.LogCaptureFixture,
) -> None:
    receiver.statuses.extend([500] * 10)
    sender = make_sender(attempts=3)
    with caplog.at_level(logging.WARNING, logger="tandem.rollouts"):
        assert sender.send(Webhook(receiver.url, SECRET), event("rolled_back"))
        await sender.flush()

    assert (sender.delivered, sender.failed, sender.dropped) == (0, 1, 0)
    assert len(receiver.requests) == 3
    [record] = [r for r in caplog.records if r.name == "tandem.rollouts"]
    message = record.getMessage()
    assert receiver.url in message
    assert "'rolled_back'" in message
    assert "HTTP 500" in message


async def test_an_unreachable_receiver_fails_without_raising(
    make_sender: Callable[..., WebhookSender],
) -> None:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sender = make_sender(attempts=2)
    assert sender.send(Webhook(f"http://127.0.0.1:{port}/hook", SECRET), event())
    await sender.flush()
    assert (sender.delivered, sender.failed, sender.dropped) == (0, 1, 0)


async def test_a_full_queue_drops_and_counts(
    receiver: Receiver,
    make_sender: Callable[..., WebhookSender],
    caplog: pytest.LogCaptureFixture,
) -> None:
    receiver.gate = asyncio.Event()
    sender = make_sender(max_queued=2)
    hook = Webhook(receiver.url, SECRET)
    assert sender.send(hook, event(rollout_id="a", n=0))
    assert sender.send(hook, event(rollout_id="b", n=0))
    with caplog.at_level(logging.WARNING, logger="tandem.rollouts"):
        assert not sender.send(hook, event(rollout_id="a", n=1))
    assert (sender.dropped, sender.queued) == (1, 2)
    assert "queue is full" in caplog.text

    receiver.gate.set()
    await sender.flush()
    assert (sender.delivered, sender.failed, sender.dropped, sender.queued) == (2, 0, 1, 0)
    # Room again once delivered.
    assert sender.send(hook, event(rollout_id="a", n=2))
    await sender.flush()
    assert receiver.events("a") == [0, 2]


async def test_one_rollouts_events_arrive_in_order(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    # Earlier events are answered more slowly: deliveries run concurrently would arrive reversed.
    receiver.delay = lambda body: (20 - body["data"]["n"]) * 0.002
    failed_once: set[int] = set()

    def answer(body: dict[str, Any]) -> int | None:
        # Rollout a's first event fails once: its retry must still come before the second.
        if body["rollout_id"] == "a" and body["data"]["n"] == 0 and not failed_once:
            failed_once.add(0)
            return 503
        return None

    receiver.answer = answer
    sender = make_sender()
    hook = Webhook(receiver.url, SECRET)
    for n in range(20):
        assert sender.send(hook, event("step_passed", rollout_id="a", n=n))
        assert sender.send(hook, event("step_passed", rollout_id="b", n=n))
    await sender.flush()

    assert (sender.delivered, sender.failed) == (40, 0)
    assert receiver.events("a") == [0, *range(20)]
    assert receiver.events("b") == list(range(20))


async def test_a_stuck_receiver_holds_up_only_its_own_rollout(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    stuck_gate = asyncio.Event()

    async def stuck(request: web.Request) -> web.Response:
        await stuck_gate.wait()
        return web.Response()

    app = web.Application()
    app.router.add_post("/stuck", stuck)
    async with served(app) as base_url:
        try:
            sender = make_sender()
            sender.send(Webhook(f"{base_url}/stuck", SECRET), event(rollout_id="a", n=0))
            sender.send(Webhook(receiver.url, SECRET), event(rollout_id="b", n=0))
            await wait_until(lambda: sender.delivered == 1)
            assert receiver.events("b") == [0]
            assert sender.queued == 1
            stuck_gate.set()
            await sender.flush()
            assert sender.delivered == 2
        finally:
            stuck_gate.set()


async def test_send_neither_waits_nor_raises(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    receiver.gate = asyncio.Event()
    sender = make_sender(timeout_s=30)
    hook = Webhook(receiver.url, SECRET)
    # The receiver answers nothing until the gate opens; send returns all the same.
    for n in range(5):
        assert sender.send(hook, event(rollout_id="a", n=n))
    assert receiver.requests == []
    assert sender.queued == 5

    # Data that is not JSON is refused at send, not in the delivery task.
    assert not sender.send(hook, event(rollout_id="a", n=object()))
    assert not sender.send(hook, event(rollout_id="a", n=float("nan")))
    assert sender.dropped == 2

    receiver.gate.set()
    await sender.flush()
    assert sender.delivered == 5
    assert receiver.events("a") == list(range(5))


def test_send_outside_an_event_loop_drops_instead_of_raising() -> None:
    sender = WebhookSender()
    assert not sender.send(Webhook("http://127.0.0.1:9/hook", SECRET), event())
    assert (sender.dropped, sender.queued) == (1, 0)


async def test_aclose_drops_what_it_cannot_deliver_and_refuses_more(
    receiver: Receiver, make_sender: Callable[..., WebhookSender]
) -> None:
    receiver.gate = asyncio.Event()
    sender = make_sender(timeout_s=30)
    hook = Webhook(receiver.url, SECRET)
    sender.send(hook, event(rollout_id="a", n=0))
    sender.send(hook, event(rollout_id="a", n=1))
    with pytest.raises(TimeoutError, match="2 webhook events still queued"):
        await sender.flush(timeout_s=0.05)

    await sender.aclose(timeout_s=0.05)
    assert (sender.delivered, sender.dropped, sender.queued) == (0, 2, 0)
    assert not sender.send(hook, event(rollout_id="a", n=2))
    assert sender.dropped == 3


async def test_a_callers_client_is_used_and_left_open(receiver: Receiver) -> None:
    import httpx

    async with httpx.AsyncClient() as client:
        sender = WebhookSender(client=client)
        sender.send(Webhook(receiver.url, SECRET), event())
        await sender.aclose()
        assert sender.delivered == 1
        assert not client.is_closed


def test_a_webhook_never_shows_its_secret() -> None:
    hook = Webhook("https://example.com/hooks/tandem", "whsec_very_secret")
    assert hook.to_dict() == {"url": "https://example.com/hooks/tandem", "secret": "***"}
    assert "whsec_very_secret" not in repr(hook)
    assert Webhook.from_dict({"url": hook.url, "secret": hook.secret}) == hook
    with pytest.raises(ValueError, match="redacted placeholder"):
        Webhook.from_dict(hook.to_dict())


@pytest.mark.parametrize(
    ("raw", "field_name"),
    [
        ({"url": "ftp://example.com/x", "secret": "s"}, "url"),
        ({"url": "example.com/x", "secret": "s"}, "url"),
        ({"url": "http://", "secret": "s"}, "url"),
        ({"url": "https://example.com/x", "secret": ""}, "secret"),
        ({"secret": "s"}, "url"),
        ({"url": "https://example.com/x"}, "secret"),
    ],
)
def test_a_webhook_refuses_bad_fields_by_name(raw: dict[str, str], field_name: str) -> None:
    with pytest.raises(ValueError, match=f"webhook {field_name}"):
        Webhook.from_dict(raw)


def test_an_event_must_be_a_known_one() -> None:
    with pytest.raises(ValueError, match="not one of: aborted, failed"):
        event("exploded")
    assert json.loads(event("aborted", reason="operator").to_body())["data"] == {
        "reason": "operator"
    }
