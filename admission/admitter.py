"""The admission controller: a bounded weighted-fair queue in front of the worker pools.

A request asks ``admit`` for an ``AdmissionSlot``. It gets one at once when capacity is free
and nobody is queued (a newcomer never jumps the queue); otherwise it waits in a ``FairQueue``
until capacity frees, its deadline passes, it is shed, or its client leaves. Every way out of
the queue is exactly one of: a slot (the request runs, then ``release``), an ``OverloadedError``
(queue full, deadline, shutdown), or the waiter's own cancellation (the entry leaves at once).

Order: the fair queue's (bands, with its starvation bound, then VTC). The head is admitted
while in-flight is under its limit: capacity, plus ``interactive_headroom`` for interactive
work. A lower-band head the queue made due (it waited ``max_band_skips`` pops) waits for the
next regular slot (in-flight under capacity), which it gets: meanwhile interactive entries may
still be admitted past it into the headroom, but at most the headroom's size of them, so an
interactive storm that refills every freed slot cannot keep in-flight at capacity forever.
Those are popped out of the queue's order (``FairQueue.pop(band)``), which counts them as no
band's skip: they cannot make a better band due meanwhile, to take the due head's slot. So a
waiting band is served within K + 2 + 2h admissions (K = ``max_band_skips``, h the headroom's
slots): the queue's K + 2 in order, and up to h past each of at most two due heads, its own
and one other (tests/properties/test_fair_queue_properties.py checks it).

Capacity comes from a ``CapacitySignal`` read whenever a slot frees, a request arrives, and
every ``poll_interval_s`` (capacity can grow with no request finishing: a worker becomes
healthy, KV cache drains). The same poll fails entries whose deadline passed, so deadlines are
enforced to within one poll interval.

Retry-after for a shed request: the time until the queue ahead of a retry would drain, estimated
as the queue length x the mean interval between recent admissions (an exponential moving
average; the time since the last admission when that is longer, so a stall raises it), clamped
to [1, 30] s. One second is the least the OpenAI SDKs honour as a hint; past 30 s a client is
better off giving up or going elsewhere than being told to sit out a guess.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeAlias

from admission.fair_queue import FairQueue, FairQueueConfig, QueueEntry
from admission.plans import PriorityBand
from core.errors import OverloadedError

RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 30.0
# Weight of the newest admission interval in the moving average (about the last 10 count).
_INTERVAL_EWMA_ALPHA = 0.2


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """Limits of the admission queue."""

    max_queue: int
    """Most requests waiting at once; past it the worst-placed one is shed."""
    max_in_flight: int
    """Capacity (requests admitted and not yet released) when no ``CapacitySignal`` is given."""
    default_queue_timeout_s: float
    """How long a request without a deadline may wait in the queue."""
    poll_interval_s: float = 0.1
    """How often capacity and deadlines are re-checked with no event to trigger it."""
    interactive_headroom: float = 0.0
    """Interactive-band requests may be admitted past capacity by this fraction of it (rounded
    up; none while capacity is 0, e.g. every decode worker KV-full). Without it, an
    interactive request behind a full engine waits for a slot to free; with it, it joins the
    engine at once, where priority scheduling runs it first (preempting batch work, which
    resumes). Bounded, so the engine is never oversubscribed by more than this."""

    def __post_init__(self) -> None:
        if self.max_queue < 0:
            raise ValueError("AdmissionConfig.max_queue must be >= 0 (0: never queue)")
        if self.max_in_flight < 0:
            raise ValueError("AdmissionConfig.max_in_flight must be >= 0")
        if not self.default_queue_timeout_s > 0:
            raise ValueError("AdmissionConfig.default_queue_timeout_s must be > 0")
        if not self.poll_interval_s > 0:
            raise ValueError("AdmissionConfig.poll_interval_s must be > 0")
        if not 0 <= self.interactive_headroom <= 1:
            raise ValueError("AdmissionConfig.interactive_headroom must be in [0, 1]")


class CapacitySignal(Protocol):
    """How many requests may be in flight right now (admitted and not released)."""

    def capacity(self) -> int:
        """Current capacity; cheap and must not raise (it is read on every admission event)."""
        ...


class FixedCapacity:
    """A constant capacity: the fallback when the gateway has no live signal."""

    def __init__(self, value: int) -> None:
        self.value = value

    def capacity(self) -> int:
        """The constant."""
        return self.value


class AdmissionSlot:
    """The right to run one request. ``release`` it (or leave its ``with`` block) when the
    request ends; until then it holds one unit of capacity. ``queue_wait_s``: seconds it
    spent in the admission queue (0 when admitted at once). ``fair_position``: the tenant's
    place in its band when granted (``FairQueue.position``; 0 = nobody active in the band is
    less served)."""

    __slots__ = ("_admitter", "_entry", "_released", "fair_position", "queue_wait_s")

    def __init__(
        self, admitter: Admitter, entry: _Entry, queue_wait_s: float, fair_position: int
    ) -> None:
        self._admitter = admitter
        self._entry = entry
        self._released = False
        self.queue_wait_s = queue_wait_s
        self.fair_position = fair_position

    @property
    def tenant_id(self) -> str:
        """The tenant the slot was granted to."""
        return self._entry.tenant_id

    @property
    def band(self) -> PriorityBand:
        """The band it was admitted in."""
        return self._entry.band

    @property
    def released(self) -> bool:
        """Whether ``release`` was called."""
        return self._released

    def charge_output(self, tokens: int) -> None:
        """Charge ``tokens`` generated output tokens to the tenant's fairness counter."""
        self._admitter._fair.charge_output(self._entry.tenant_id, self._entry.weight, tokens)

    def release(self) -> None:
        """Free the capacity and admit the next waiter. Idempotent."""
        if not self._released:
            self._released = True
            self._admitter._release(self._entry)

    def __enter__(self) -> AdmissionSlot:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


# The queue's payload is the waiter's future; `admit` resolves it with a slot or an error.
_Entry: TypeAlias = QueueEntry[asyncio.Future[AdmissionSlot]]


class Admitter:
    """Bounded weighted-fair admission over a capacity signal. ``start`` / ``aclose``."""

    def __init__(
        self,
        config: AdmissionConfig,
        capacity: CapacitySignal | None = None,
        fair: FairQueueConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._capacity = capacity if capacity is not None else FixedCapacity(config.max_in_flight)
        self._fair: FairQueue[asyncio.Future[AdmissionSlot]] = FairQueue(fair)
        self._clock = clock
        self._num_in_flight = 0
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self._last_admitted_at = clock()
        self._mean_interval_s = 0.0
        self._num_past_due = 0
        """Interactive admissions past a due entry's head since the last other admission."""

    @property
    def num_queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._fair)

    @property
    def capacity(self) -> int:
        """Requests the capacity signal allows in flight right now."""
        return self._capacity.capacity()

    @property
    def num_in_flight(self) -> int:
        """Slots held (admitted, not yet released)."""
        return self._num_in_flight

    @property
    def fair_queue(self) -> FairQueue[asyncio.Future[AdmissionSlot]]:
        """The policy underneath (read its counters; do not push or pop)."""
        return self._fair

    async def start(self) -> None:
        """Begin re-checking capacity and deadlines every poll interval."""
        if self._task is not None or self._closed:
            raise RuntimeError("admitter already started or closed")
        self._task = asyncio.create_task(self._poll_loop(), name="admission poll")

    async def aclose(self) -> None:
        """Stop admitting: every queued waiter and every later ``admit`` gets OverloadedError.
        Slots already granted stay valid until released."""
        self._closed = True
        for entry in list(self._fair.entries()):
            self._fail(entry, OverloadedError("shutting down", retry_after_s=RETRY_AFTER_MIN_S))
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def admit(
        self,
        tenant_id: str,
        weight: float,
        band: PriorityBand,
        prompt_tokens: int,
        deadline: float | None,
    ) -> AdmissionSlot:
        """Wait for a slot, in weighted-fair order within ``band``. ``deadline`` is on this
        admitter's clock (monotonic seconds); None means now + ``default_queue_timeout_s``.

        Raises OverloadedError when shed (queue full, or displaced by a better newcomer), when
        the deadline passes first, or on shutdown. Cancelling the caller takes its entry out of
        the queue at once, and releases the slot if one was granted in the same instant.
        """
        if self._closed:
            raise OverloadedError("shutting down", retry_after_s=RETRY_AFTER_MIN_S)
        now = self._clock()
        if deadline is None:
            deadline = now + self._config.default_queue_timeout_s
        if deadline <= now:
            raise OverloadedError(
                "the request's deadline passed before it could be admitted",
                retry_after_s=self._retry_after_s(now),
            )
        loop = asyncio.get_running_loop()
        entry: _Entry = QueueEntry(
            tenant_id, weight, band, prompt_tokens, now, deadline, loop.create_future()
        )
        self._dispatch()  # capacity may have grown since the last event: queue only if full
        if not self._fair and self._num_in_flight < self._limit(band, self._capacity.capacity()):
            return self._slot(entry, now, self._fair.admit_at_once(entry), past_due=False)
        if len(self._fair) >= self._config.max_queue:
            victim = self._fair.shed_for(tenant_id, band)
            retry_after_s = self._retry_after_s(now)
            if victim is None:
                raise OverloadedError("the admission queue is full", retry_after_s=retry_after_s)
            self._fail(
                victim,
                OverloadedError(
                    "shed from the admission queue for a higher-priority request",
                    retry_after_s=retry_after_s,
                ),
            )
        self._fair.push(entry)
        self._dispatch()  # an interactive newcomer may use the headroom past queued work
        return await self._wait(entry)

    def poll(self) -> None:
        """Fail entries past their deadline, then admit while capacity allows. The background
        task calls this every poll interval; call it directly when capacity is known to have
        grown (a worker became healthy) to skip the wait."""
        now = self._clock()
        for entry in self._fair.expired(now):
            self._fail(entry, self._deadline_error(now))
        self._dispatch()

    # -- internals -------------------------------------------------------------------------

    async def _wait(self, entry: _Entry) -> AdmissionSlot:
        future = entry.payload
        try:
            return await future
        except asyncio.CancelledError:
            # The client left. Cancelling this task cancelled the future unless a slot (or an
            # error) had already been set on it in the same loop iteration.
            self._fair.remove(entry)
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()
            raise

    def _limit(self, band: PriorityBand, capacity: int) -> int:
        """How many in flight a request of ``band`` may join: capacity, plus the headroom for
        interactive work."""
        if band is PriorityBand.INTERACTIVE and capacity > 0:
            return capacity + math.ceil(capacity * self._config.interactive_headroom)
        return capacity

    def _dispatch(self) -> None:
        """Admit queued entries, head first, while in-flight is under the head's limit:
        capacity never idles while a request waits. A head over its limit is a lower band the
        queue made due: it keeps its claim on the next regular slot, while the best interactive
        entry may still take the headroom past it."""
        if not self._fair:
            return
        now = self._clock()
        capacity = self._capacity.capacity()
        while (entry := self._fair.peek()) is not None:
            # Over its limit, the head is a due lower band (or the headroom is full).
            past_due = self._num_in_flight >= self._limit(entry.band, capacity)
            if past_due:
                headroom = self._limit(PriorityBand.INTERACTIVE, capacity) - capacity
                entry = self._fair.peek(PriorityBand.INTERACTIVE)
                if (
                    entry is None
                    or self._num_in_flight >= capacity + headroom
                    or self._num_past_due >= headroom
                ):
                    return
            if entry.payload.done():
                # Its waiter was cancelled and has not run its cleanup yet: not charged.
                self._fair.remove(entry)
            elif entry.deadline is not None and entry.deadline <= now:
                self._fail(entry, self._deadline_error(now))
            else:
                entry.payload.set_result(self._grant(entry, now, past_due=past_due))

    def _grant(self, entry: _Entry, now: float, *, past_due: bool = False) -> AdmissionSlot:
        """Pop ``entry`` (the head of its band) and give it a slot; ``past_due``: an
        interactive entry admitted into the headroom past a due entry."""
        # Its tenant's place before its own prompt is charged: where it stood when chosen.
        fair_position = self._fair.position(entry.tenant_id, entry.band)
        popped = self._fair.pop(entry.band)
        assert popped is entry, "granted an entry that is not the head of its band"
        return self._slot(entry, now, fair_position, past_due=past_due)

    def _slot(
        self, entry: _Entry, now: float, fair_position: int, *, past_due: bool
    ) -> AdmissionSlot:
        """The slot of ``entry``, just taken from the fair queue."""
        self._num_past_due = self._num_past_due + 1 if past_due else 0
        self._num_in_flight += 1
        interval = now - self._last_admitted_at
        self._mean_interval_s += _INTERVAL_EWMA_ALPHA * (interval - self._mean_interval_s)
        self._last_admitted_at = now
        return AdmissionSlot(self, entry, now - entry.enqueued_at, fair_position)

    def _release(self, entry: _Entry) -> None:
        self._num_in_flight -= 1
        self._fair.finish(entry)
        self._dispatch()

    def _fail(self, entry: _Entry, error: OverloadedError) -> None:
        self._fair.remove(entry)
        if not entry.payload.done():
            entry.payload.set_exception(error)

    def _deadline_error(self, now: float) -> OverloadedError:
        return OverloadedError(
            "the request could not be admitted before its deadline",
            retry_after_s=self._retry_after_s(now),
        )

    def _retry_after_s(self, now: float) -> float:
        """Queue length x recent mean admission interval, clamped (see the module docstring)."""
        interval = max(self._mean_interval_s, now - self._last_admitted_at)
        estimate = interval * max(1, len(self._fair))
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, estimate))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.poll_interval_s)
            self.poll()
