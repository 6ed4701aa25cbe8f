"""Signed webhooks for rollout events: what a rollout tells the outside world as it moves.

A rollout may name a ``Webhook`` (a URL and a shared secret). Each event it goes through
(``EVENTS``) becomes a ``WebhookEvent`` that ``WebhookSender.send`` queues without waiting; a
background task per rollout POSTs the rollout's events in order, retrying with exponential
backoff, and counts what was ``delivered``, what ``failed`` after every attempt and what was
``dropped`` (queue full, body not JSON-able, sender closed). Nothing is ever raised into the
code that sent the event: a webhook is a notification, never a reason to stall a rollout.

Each delivery is a ``POST`` of the event as JSON (``WebhookEvent.to_body``) with the headers:

- ``content-type: application/json``
- ``x-tandem-event``: the event name; ``x-tandem-delivery``: the delivery id, the same on every
  retry of one event, so a receiver can drop duplicates.
- ``x-tandem-signature: t=<unix seconds>,v1=<hex HMAC-SHA256>`` over ``f"{t}.".encode() + body``
  with the webhook's secret (Stripe's scheme). The timestamp sits inside the MAC so a captured
  request cannot be replayed later with a fresh timestamp; each attempt is signed anew.

A receiver checks a request with ``verify`` before trusting it, on the raw body bytes (parsing
and re-serialising the JSON changes the bytes and breaks the signature)::

    from rollouts.webhook import SIGNATURE_HEADER, verify

    body = await request.body()
    if not verify(SECRET, request.headers.get(SIGNATURE_HEADER, ""), body):
        return Response(status_code=400)

Any 2xx answer counts as delivered; any other status, a timeout or a connection error is
retried (``attempts`` in all, waiting ``backoff_s``, then twice that, and so on) and then logged
as a warning on the ``tandem.rollouts`` logger naming the URL, the event and the last status.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = [
    "EVENTS",
    "SIGNATURE_HEADER",
    "Webhook",
    "WebhookEvent",
    "WebhookSender",
    "sign",
    "verify",
]

log = logging.getLogger("tandem.rollouts")

SIGNATURE_HEADER = "x-tandem-signature"
EVENT_HEADER = "x-tandem-event"
DELIVERY_HEADER = "x-tandem-delivery"

EVENTS = frozenset(
    {
        "started",
        "step_passed",
        "failed",
        "promoted",
        "rolled_back",
        "paused",
        "resumed",
        "aborted",
        "succeeded",
    }
)
"""The events a rollout reports."""

REDACTED = "***"
"""What ``Webhook.to_dict`` writes in place of the secret."""


@dataclass(frozen=True, slots=True)
class Webhook:
    """Where a rollout's events go, and the secret they are signed with."""

    url: str
    """An ``http://`` or ``https://`` URL."""
    secret: str = field(repr=False)
    """Shared with the receiver, which checks signatures with it (``verify``). Never shown:
    not in ``repr`` nor in ``to_dict``."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str):
            raise ValueError("webhook url must be a string such as 'https://example.com/hook'")
        try:
            url = httpx.URL(self.url)
        except httpx.InvalidURL:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host:
            raise ValueError(
                f"webhook url {self.url!r} must be an http:// or https:// URL with a host"
            )
        if not isinstance(self.secret, str) or not self.secret:
            raise ValueError("webhook secret must be a non-empty string shared with the receiver")

    def to_dict(self) -> dict[str, str]:
        """JSON-able, with the secret redacted (``"***"``): safe to show or log."""
        return {"url": self.url, "secret": REDACTED}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Webhook:
        """A webhook from ``{"url": ..., "secret": ...}``. Refuses the redacted secret of
        ``to_dict``: a hook read back from a listing would sign with ``"***"``."""
        for name in ("url", "secret"):
            if name not in raw:
                raise ValueError(f"webhook {name} is missing: give both 'url' and 'secret'")
        if raw["secret"] == REDACTED:
            raise ValueError(
                "webhook secret is the redacted placeholder '***': give the real secret"
            )
        return cls(url=raw["url"], secret=raw["secret"])


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for ``body`` sent at ``timestamp`` (unix seconds):
    ``t=<timestamp>,v1=<hex HMAC-SHA256 of f"{timestamp}.".encode() + body>``."""
    return f"t={timestamp},v1={_mac(secret, timestamp, body)}"


def verify(
    secret: str,
    header: str,
    body: bytes,
    *,
    tolerance_s: float = 300,
    now: float | None = None,
) -> bool:
    """Whether ``header`` (the ``x-tandem-signature`` value) signs the raw ``body`` with
    ``secret``, at a timestamp within ``tolerance_s`` of ``now`` (default: the current time).

    What a receiver runs before trusting a delivery. A malformed header is False, never an
    exception. Several ``v1=`` entries are accepted, any one matching (room for rotating the
    secret). The comparison is constant-time, so timing reveals nothing of the expected MAC.
    """
    timestamp: int | None = None
    candidates: list[str] = []
    for item in header.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep:
            return False
        if key == "t":
            try:
                timestamp = int(value)
            except ValueError:
                return False
        elif key == "v1":
            candidates.append(value)
    if timestamp is None or not candidates:
        return False
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance_s:
        return False
    expected = _mac(secret, timestamp, body)
    # No early exit: each candidate is compared in full, in constant time.
    matched = False
    for candidate in candidates:
        matched |= hmac.compare_digest(expected, candidate)
    return matched


def _mac(secret: str, timestamp: int, body: bytes) -> str:
    message = f"{timestamp}.".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class WebhookEvent:
    """One event of one rollout, as delivered."""

    event: str
    """One of ``EVENTS``."""
    rollout_id: str
    alias: str
    """The alias the rollout moves traffic under."""
    at: float
    """When it happened, unix seconds."""
    data: Mapping[str, Any]
    """Event details (weights, versions, the failed gate's measurements); JSON-able."""
    delivery_id: str
    """Unique per event and kept across retries, so a receiver can drop duplicates."""

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(
                f"webhook event {self.event!r} is not one of: {', '.join(sorted(EVENTS))}"
            )
        if not self.rollout_id:
            raise ValueError("webhook event rollout_id must be non-empty")
        if not self.delivery_id:
            raise ValueError("webhook event delivery_id must be non-empty (a uuid4 hex will do)")
        if not math.isfinite(self.at):
            raise ValueError(f"webhook event at must be a finite unix time, not {self.at!r}")

    def to_body(self) -> bytes:
        """The JSON body, keys sorted: ``{"alias", "at", "data", "event", "id", "rollout_id"}``.
        Raises ``TypeError`` or ``ValueError`` when ``data`` is not JSON-able."""
        payload = {
            "id": self.delivery_id,
            "event": self.event,
            "rollout_id": self.rollout_id,
            "alias": self.alias,
            "at": self.at,
            "data": dict(self.data),
        }
        return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True, slots=True)
class _Delivery:
    hook: Webhook
    event: WebhookEvent
    body: bytes


class WebhookSender:
    """Delivers webhook events in the background, in order per rollout, with retries.

    ``send`` never waits and never raises. Each rollout with events queued has one delivery
    task (kept in a dict this object owns), so a slow receiver delays only its own rollout's
    events; the task ends when its rollout's queue is empty. ``aclose`` drains briefly, then
    cancels what is left and counts it as dropped.
    """

    def __init__(
        self,
        *,
        client: httpx.AsyncClient | None = None,
        timeout_s: float = 5.0,
        attempts: int = 4,
        backoff_s: float = 0.5,
        max_queued: int = 1000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``client``: an HTTP client the caller owns (and closes); without one the sender makes
        its own and closes it in ``aclose``. ``timeout_s``: per attempt. ``attempts``: tries
        per event, the first included. ``backoff_s``: wait before the second attempt, doubled
        before each further one. ``max_queued``: events queued or in flight, all rollouts
        together, past which ``send`` drops. ``clock``: unix seconds for signature timestamps.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be more than 0, not {timeout_s}")
        if attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {attempts}")
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be at least 0, not {backoff_s}")
        if max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, not {max_queued}")
        self._client = client
        self._owns_client = client is None
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._backoff_s = backoff_s
        self._max_queued = max_queued
        self._clock = clock
        self._queues: dict[str, collections.deque[_Delivery]] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._num_queued = 0
        self._closed = False
        self._delivered = 0
        self._failed = 0
        self._dropped = 0

    @property
    def delivered(self) -> int:
        """Events a receiver answered with a 2xx."""
        return self._delivered

    @property
    def failed(self) -> int:
        """Events given up on after ``attempts`` tries."""
        return self._failed

    @property
    def dropped(self) -> int:
        """Events never tried to the end: queue full, body not JSON-able, no running event
        loop, or still queued when ``aclose`` gave up waiting."""
        return self._dropped

    @property
    def queued(self) -> int:
        """Events queued or being delivered."""
        return self._num_queued

    def send(self, hook: Webhook, event: WebhookEvent) -> bool:
        """Queue ``event`` for ``hook`` and return at once: True if queued, False (with a
        warning, counted in ``dropped``) if not. Must be called on the running event loop, whose
        delivery tasks it starts. Events of one rollout are delivered in the order sent."""
        why = self._refusal()
        if why is None:
            try:
                body = event.to_body()
            except (TypeError, ValueError) as exc:
                why = f"its data is not JSON-able ({exc})"
        if why is not None:
            self._dropped += 1
            log.warning(
                "webhook %s event %r of rollout %s dropped: %s",
                hook.url, event.event, event.rollout_id, why,
            )  # fmt: skip
            return False
        # The body is serialised now: later changes to ``event.data`` cannot reach the receiver.
        queue = self._queues.setdefault(event.rollout_id, collections.deque())
        queue.append(_Delivery(hook, event, body))
        self._num_queued += 1
        if event.rollout_id not in self._tasks:
            task = asyncio.get_running_loop().create_task(
                self._deliver_all(event.rollout_id), name=f"webhooks {event.rollout_id}"
            )
            task.add_done_callback(self._crashed)
            self._tasks[event.rollout_id] = task
        return True

    @staticmethod
    def _crashed(task: asyncio.Task[None]) -> None:
        # Only a bug gets here (delivery errors are caught and counted): say so, once.
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("webhook delivery task %s crashed", task.get_name(), exc_info=exc)

    def _refusal(self) -> str | None:
        if self._closed:
            return "the sender is closed"
        if self._num_queued >= self._max_queued:
            return f"the queue is full ({self._max_queued} events)"
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return "send was called outside a running event loop"
        return None

    async def flush(self, timeout_s: float = 10) -> None:
        """Wait until every queued event is delivered or given up on. Raises ``TimeoutError``
        (the events stay queued) when that takes more than ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Events sent while waiting can start new tasks: wait again until none is left.
        while self._tasks:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(
                    f"{self._num_queued} webhook events still queued after {timeout_s:g} s"
                )
            await asyncio.wait(list(self._tasks.values()), timeout=remaining)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Refuse new events, wait up to ``timeout_s`` for the queued ones, then cancel what is
        left (counted in ``dropped``, with a warning) and close the client if the sender made
        it."""
        self._closed = True
        try:
            await self.flush(timeout_s)
        except TimeoutError:
            log.warning(
                "webhooks: %d events still queued at shutdown after %g s; dropping them",
                self._num_queued, timeout_s,
            )  # fmt: skip
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel("webhook sender closed")
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _deliver_all(self, rollout_id: str) -> None:
        """Deliver ``rollout_id``'s queue in order until it is empty. The task's entry goes with
        the last event, with no ``await`` in between: a ``send`` after that starts a new task."""
        queue = self._queues[rollout_id]
        try:
            while queue:
                item = queue[0]
                # The event leaves the queue only once handled, so cancellation counts it.
                await self._deliver(item)
                queue.popleft()
                self._num_queued -= 1
        finally:
            if queue:
                self._dropped += len(queue)
                self._num_queued -= len(queue)
                queue.clear()
            del self._queues[rollout_id]
            del self._tasks[rollout_id]

    async def _deliver(self, item: _Delivery) -> None:
        """One event, up to ``attempts`` tries; counts the outcome."""
        client = self._client
        if client is None:
            client = self._client = httpx.AsyncClient()
        last = ""
        for attempt in range(self._attempts):
            if attempt > 0:
                await asyncio.sleep(self._backoff_s * 2 ** (attempt - 1))
            headers = {
                "content-type": "application/json",
                SIGNATURE_HEADER: sign(item.hook.secret, int(self._clock()), item.body),
                EVENT_HEADER: item.event.event,
                DELIVERY_HEADER: item.event.delivery_id,
            }
            try:
                response = await client.post(
                    item.hook.url, content=item.body, headers=headers, timeout=self._timeout_s
                )
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            if response.is_success:
                self._delivered += 1
                return
            last = f"HTTP {response.status_code}"
        self._failed += 1
        log.warning(
            "webhook %s event %r of rollout %s failed after %d attempts: %s",
            item.hook.url, item.event.event, item.event.rollout_id, self._attempts, last,
        )  # fmt: skip
