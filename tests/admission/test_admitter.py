"""Admitter: immediate admission, fair queueing, shedding, deadlines, cancellation, capacity
growth, shutdown, starvation (within and across bands), headroom, fair positions. A fake
capacity signal and a fake clock; real asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest

from admission.admitter import (
    RETRY_AFTER_MAX_S,
    RETRY_AFTER_MIN_S,
    AdmissionConfig,
    AdmissionSlot,
    Admitter,
)
from admission.fair_queue import FairQueueConfig
from admission.plans import PriorityBand
from core.errors import OverloadedError

STANDARD = PriorityBand.STANDARD
INTERACTIVE = PriorityBand.INTERACTIVE
BATCH = PriorityBand.BATCH


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeCapacity:
    """A capacity signal a test sets by hand."""

    def __init__(self, value: int) -> None:
        self.value = value

    def capacity(self) -> int:
        return self.value


class Harness:
    def __init__(self, admitter: Admitter, capacity: FakeCapacity, clock: FakeClock) -> None:
        self.admitter = admitter
        self.capacity = capacity
        self.clock = clock
        self.order: list[str] = []
        self.tasks: list[asyncio.Task[AdmissionSlot]] = []

    def waiter(
        self,
        name: str,
        tenant: str,
        band: PriorityBand = STANDARD,
        *,
        prompt: int = 10,
        deadline: float | None = None,
    ) -> asyncio.Task[AdmissionSlot]:
        """A request waiting for admission; it records its name in ``order`` when admitted."""

        async def wait() -> AdmissionSlot:
            slot = await self.admitter.admit(tenant, 1.0, band, prompt, deadline)
            self.order.append(name)
            return slot

        task = asyncio.create_task(wait(), name=name)
        self.tasks.append(task)
        return task

    async def admit(self, tenant: str, band: PriorityBand = STANDARD) -> AdmissionSlot:
        return await self.admitter.admit(tenant, 1.0, band, 10, None)


MakeHarness = Callable[..., Coroutine[Any, Any, Harness]]


@pytest.fixture
async def make() -> AsyncIterator[MakeHarness]:
    """Build started admitters (closed, with their waiters, at teardown)."""
    harnesses: list[Harness] = []

    async def build(
        capacity: int = 1,
        max_queue: int = 8,
        poll_interval_s: float = 60.0,
        interactive_headroom: float = 0.0,
        max_band_skips: int = 8,
    ) -> Harness:
        # A long poll interval by default: tests drive polls by hand unless they test the loop.
        config = AdmissionConfig(
            max_queue=max_queue,
            max_in_flight=capacity,
            default_queue_timeout_s=30.0,
            poll_interval_s=poll_interval_s,
            interactive_headroom=interactive_headroom,
        )
        signal, clock = FakeCapacity(capacity), FakeClock()
        fair = FairQueueConfig(max_band_skips=max_band_skips)
        admitter = Admitter(config, signal, fair, clock=clock)
        await admitter.start()
        harness = Harness(admitter, signal, clock)
        harnesses.append(harness)
        return harness

    yield build
    for harness in harnesses:
        await harness.admitter.aclose()
        await asyncio.gather(*harness.tasks, return_exceptions=True)


async def release_in_turn(tasks: list[asyncio.Task[AdmissionSlot]]) -> list[AdmissionSlot]:
    """Release each waiter's slot as soon as it is admitted, until all are; the slots."""
    slots: list[AdmissionSlot] = []
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(
            pending, timeout=5.0, return_when=asyncio.FIRST_COMPLETED
        )
        assert done, "nobody was admitted although capacity was released"
        for task in done:
            slots.append(task.result())
            slots[-1].release()
    return slots


async def settle() -> None:
    """Let every ready task run (a few loop iterations)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_admits_at_once_when_capacity_is_free(make: MakeHarness) -> None:
    h = await make(capacity=2)
    slot = await h.admit("a")
    assert slot.queue_wait_s == 0.0
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (1, 0)
    assert h.admitter.fair_queue.counter("a") == pytest.approx(10.0)  # prompt charged
    slot.charge_output(5)
    assert h.admitter.fair_queue.counter("a") == pytest.approx(20.0)
    slot.release()
    slot.release()  # idempotent
    assert h.admitter.num_in_flight == 0
    with await h.admit("a") as held:
        assert h.admitter.num_in_flight == 1 and not held.released
    assert h.admitter.num_in_flight == 0 and held.released


async def test_queues_when_full_and_release_dispatches_in_fair_order(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    for i in range(3):
        h.waiter(f"a{i}", "a")
    h.waiter("b0", "b")
    await settle()
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (1, 4)
    assert h.order == []

    h.clock.advance(2.5)
    holder.release()
    first = await asyncio.wait_for(h.tasks[0], timeout=5.0)
    assert first.queue_wait_s == pytest.approx(2.5)  # a0 was at the head, since t=0
    first.release()
    await release_in_turn(h.tasks[1:])
    # Not FIFO (a0 a1 a2 b0): b gets its turn before a's second queued request.
    assert h.order.index("b0") < h.order.index("a1")
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (0, 0)


async def test_a_newcomer_never_jumps_the_queue(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    first = h.waiter("first", "b")
    await settle()
    h.capacity.value = 2  # capacity grew; no poll has noticed yet
    late = h.waiter("late", "c")
    await settle()
    assert first.done() and not late.done()
    assert h.order == ["first"]
    holder.release()
    (await first).release()
    (await late).release()


async def test_full_queue_sheds_the_newcomer(make: MakeHarness) -> None:
    h = await make(capacity=1, max_queue=2)
    holder = await h.admit("a")
    queued = [h.waiter(f"a{i}", "a") for i in range(2)]
    await settle()
    with pytest.raises(OverloadedError, match="queue is full") as shed:
        await h.admit("a")
    assert shed.value.status_code == 503
    assert shed.value.retry_after_s is not None
    assert RETRY_AFTER_MIN_S <= shed.value.retry_after_s <= RETRY_AFTER_MAX_S
    assert h.admitter.num_queued == 2
    holder.release()
    for task in queued:
        (await task).release()


async def test_a_better_band_newcomer_evicts_a_batch_entry(make: MakeHarness) -> None:
    h = await make(capacity=1, max_queue=2)
    holder = await h.admit("chat", PriorityBand.INTERACTIVE)
    bulk_old = h.waiter("bulk-old", "bulk", PriorityBand.BATCH)
    bulk_new = h.waiter("bulk-new", "bulk", PriorityBand.BATCH)
    await settle()
    chat = h.waiter("chat", "chat", PriorityBand.INTERACTIVE)
    await settle()
    with pytest.raises(OverloadedError, match="higher-priority") as shed:
        await bulk_new  # the newest entry of the batch tenant is the one shed
    assert shed.value.retry_after_s is not None
    assert h.admitter.num_queued == 2
    # Another batch newcomer is not better than the batch entry left: it is shed itself.
    with pytest.raises(OverloadedError, match="queue is full"):
        await h.admit("other-bulk", PriorityBand.BATCH)
    holder.release()
    (await chat).release()
    (await bulk_old).release()
    assert h.order == ["chat", "bulk-old"]


async def test_deadline_passing_in_the_queue_fails_the_request(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    soon = h.waiter("soon", "a", deadline=h.clock.now + 5)
    later = h.waiter("later", "b")  # no deadline: the default 30 s queue timeout
    await settle()
    h.clock.advance(5)
    h.admitter.poll()
    with pytest.raises(OverloadedError, match="before its deadline") as expired:
        await soon
    assert expired.value.retry_after_s is not None
    assert h.admitter.num_queued == 1
    h.clock.advance(25)
    h.admitter.poll()
    with pytest.raises(OverloadedError, match="before its deadline"):
        await later
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (1, 0)
    holder.release()


async def test_an_expired_entry_is_not_admitted_when_capacity_frees(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    stale = h.waiter("stale", "a", deadline=h.clock.now + 1)
    fresh = h.waiter("fresh", "b")
    await settle()
    h.clock.advance(2)  # no poll ran: the release finds the expired entry first
    holder.release()
    with pytest.raises(OverloadedError, match="before its deadline"):
        await stale
    (await fresh).release()
    assert h.order == ["fresh"]


async def test_a_deadline_already_past_fails_at_once(make: MakeHarness) -> None:
    h = await make(capacity=5)
    with pytest.raises(OverloadedError, match="deadline passed"):
        await h.admitter.admit("a", 1.0, STANDARD, 10, deadline=h.clock.now)
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (0, 0)


async def test_cancelling_a_queued_waiter_removes_it_at_once(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    gone = h.waiter("gone", "b")
    stays = h.waiter("stays", "c")
    await settle()
    assert h.admitter.num_queued == 2
    gone.cancel()
    await asyncio.sleep(0)  # one step of the cancelled task; no poll, no release
    assert h.admitter.num_queued == 1
    with pytest.raises(asyncio.CancelledError):
        await gone
    holder.release()
    (await stays).release()
    assert h.order == ["stays"]
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (0, 0)


async def test_a_slot_granted_as_the_waiter_is_cancelled_is_released(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    racing = h.waiter("racing", "b")
    await settle()
    holder.release()  # grants the slot to `racing`, which has not run yet...
    assert h.admitter.num_in_flight == 1
    racing.cancel()  # ...and its client leaves in the same instant
    with pytest.raises(asyncio.CancelledError):
        await racing
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (0, 0)
    (await h.admit("c")).release()  # capacity is really free again


async def test_capacity_growth_is_picked_up_by_the_poll_loop(make: MakeHarness) -> None:
    h = await make(capacity=0, poll_interval_s=0.01)
    waiters = [h.waiter(f"w{i}", f"t{i}") for i in range(3)]
    await settle()
    assert h.admitter.num_queued == 3
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in waiters)  # the poll loop runs, capacity is 0
    h.capacity.value = 2  # a worker became healthy: no request finished to notice it
    pending, admitted = set(waiters), 0
    while admitted < 2:
        done, pending = await asyncio.wait(
            pending, timeout=5.0, return_when=asyncio.FIRST_COMPLETED
        )
        assert done, "the poll loop did not notice the new capacity"
        admitted += len(done)
    await settle()
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (2, 1)
    await release_in_turn(waiters)


async def test_aclose_fails_every_waiter_and_later_admissions(make: MakeHarness) -> None:
    h = await make(capacity=1)
    holder = await h.admit("a")
    waiters = [h.waiter(f"w{i}", "b") for i in range(3)]
    await settle()
    await h.admitter.aclose()
    for task in waiters:
        with pytest.raises(OverloadedError, match="shutting down"):
            await task
    with pytest.raises(OverloadedError, match="shutting down"):
        await h.admit("c")
    holder.release()  # a slot granted before shutdown stays valid and releases cleanly
    assert (h.admitter.num_in_flight, h.admitter.num_queued) == (0, 0)


async def test_interleaved_tenants_are_all_admitted_without_starvation(make: MakeHarness) -> None:
    h = await make(capacity=1, max_queue=64)
    holder = await h.admit("heavy")
    for i in range(20):
        h.waiter(f"heavy-{i}", "heavy")
    await settle()
    for tenant in ("x", "y"):
        for i in range(3):
            h.waiter(f"{tenant}-{i}", tenant)
    await settle()
    holder.release()
    await release_in_turn(h.tasks)
    assert len(h.order) == 26
    # The late light tenants are not stuck behind heavy's 20: they share turns with it.
    first_ten = h.order[:10]
    assert sum(name.startswith(("x", "y")) for name in first_ten) >= 6


async def test_retry_after_grows_with_the_queue_and_a_stall_and_is_clamped(
    make: MakeHarness,
) -> None:
    h = await make(capacity=1, max_queue=2)
    h.clock.advance(10)
    for _ in range(5):  # one admission a second
        h.clock.advance(1)
        (await h.admit("a")).release()
    holder = await h.admit("a")
    queued = [h.waiter(f"q{i}", "b") for i in range(2)]
    await settle()
    with pytest.raises(OverloadedError) as shed:
        await h.admit("c")
    assert shed.value.retry_after_s is not None
    assert 1.0 <= shed.value.retry_after_s <= 10.0  # about 2 queued x a few s each
    h.clock.advance(600)  # admissions stalled for 10 minutes
    with pytest.raises(OverloadedError) as stalled:
        await h.admit("c")
    assert stalled.value.retry_after_s == RETRY_AFTER_MAX_S
    holder.release()
    for task in queued:  # their 30 s default queue timeout passed during the stall
        with pytest.raises(OverloadedError, match="before its deadline"):
            await task


# --- Interactive headroom: interactive work joins a full engine, by a bounded amount ---------


async def test_interactive_work_is_admitted_past_a_full_capacity_by_the_headroom(
    make: MakeHarness,
) -> None:
    h = await make(capacity=4, interactive_headroom=0.25)  # one slot over the cap (ceil 4 x 0.25)
    held = [await h.admit(f"bulk-{i}") for i in range(4)]
    standard = h.waiter("standard", "bulk")
    first = h.waiter("chat-1", "chat", INTERACTIVE)
    second = h.waiter("chat-2", "chat", INTERACTIVE)
    await settle()
    # The first interactive request passed the queued standard one and the cap; the second
    # finds the headroom used up and waits, like the standard one.
    assert h.order == ["chat-1"] and h.admitter.num_in_flight == 5
    assert not standard.done() and not second.done()
    first.result().release()
    await settle()
    assert h.order == ["chat-1", "chat-2"]  # interactive still goes first within the headroom
    held[0].release()
    await settle()
    assert not standard.done()  # 5 in flight: at the cap plus the headroom's one
    second.result().release()
    await settle()
    assert h.order == ["chat-1", "chat-2", "standard"]
    for slot in held[1:]:
        slot.release()


async def test_no_headroom_while_capacity_is_zero(make: MakeHarness) -> None:
    h = await make(capacity=2, interactive_headroom=1.0)
    h.capacity.value = 0  # every decode worker KV-full or unhealthy
    chat = h.waiter("chat", "chat", INTERACTIVE)
    await settle()
    assert not chat.done()
    h.capacity.value = 2
    h.admitter.poll()
    await settle()
    assert h.order == ["chat"]


async def test_standard_and_batch_work_never_use_the_headroom(make: MakeHarness) -> None:
    h = await make(capacity=2, interactive_headroom=1.0)
    held = [await h.admit("a"), await h.admit("b")]
    waiting = [h.waiter("std", "c"), h.waiter("batch", "d", BATCH)]
    await settle()
    assert h.order == [] and h.admitter.num_in_flight == 2
    for slot in held:
        slot.release()
    await release_in_turn(waiting)
    assert h.order == ["std", "batch"]


def test_the_headroom_is_a_fraction_of_capacity() -> None:
    with pytest.raises(ValueError, match="interactive_headroom"):
        AdmissionConfig(
            max_queue=1, max_in_flight=1, default_queue_timeout_s=1.0, interactive_headroom=1.5
        )


# --- Across bands: the starvation bound, and the headroom past a due entry --------------------


async def release_in_order(h: Harness, total: int) -> None:
    """Release each admitted slot in admission order until ``total`` were admitted."""
    released = 0
    while released < total:
        await settle()
        done = [t for t in h.tasks if t.done() and not t.result().released]
        assert done, "nobody was admitted although capacity was released"
        for task in done:
            task.result().release()
            released += 1


@pytest.mark.parametrize(("max_band_skips", "batch_turn"), [(2, 2), (8, 8), (0, 20)])
async def test_an_interactive_storm_cannot_starve_a_batch_request(
    make: MakeHarness, max_band_skips: int, batch_turn: int
) -> None:
    h = await make(capacity=1, max_queue=64, max_band_skips=max_band_skips)
    holder = await h.admit("chat", INTERACTIVE)
    h.waiter("bulk", "bulk", BATCH)
    for i in range(20):
        h.waiter(f"chat-{i}", "chat", INTERACTIVE)
    await settle()
    holder.release()
    await release_in_order(h, 21)
    # K interactive admissions while it waited, then it; with K = 0, strict: after them all.
    assert h.order.index("bulk") == batch_turn


async def test_a_batch_tenant_alone_gets_all_the_capacity(make: MakeHarness) -> None:
    h = await make(capacity=3, interactive_headroom=1.0)
    for i in range(6):
        h.waiter(f"bulk-{i}", "bulk", BATCH)
    await settle()
    assert h.order == ["bulk-0", "bulk-1", "bulk-2"] and h.admitter.num_in_flight == 3
    await release_in_order(h, 6)
    assert h.order == [f"bulk-{i}" for i in range(6)]


async def test_all_tenants_interactive_take_turns(make: MakeHarness) -> None:
    h = await make(capacity=1, max_queue=64)
    holder = await h.admit("a", INTERACTIVE)
    for tenant in ("a", "b", "c"):
        for i in range(4):
            h.waiter(f"{tenant}-{i}", tenant, INTERACTIVE)
    await settle()
    holder.release()
    await release_in_order(h, 12)
    # Not FIFO (four a's first): every round of three has one of each.
    rounds = [sorted(name[0] for name in h.order[i : i + 3]) for i in range(0, 12, 3)]
    assert rounds == [["a", "b", "c"]] * 4


async def test_headroom_stays_usable_past_a_due_batch_entry_which_gets_the_next_regular_slot(
    make: MakeHarness,
) -> None:
    h = await make(capacity=2, interactive_headroom=1.0, max_band_skips=1)  # 2 headroom slots
    held = [await h.admit("a"), await h.admit("b")]
    h.waiter("bulk", "bulk", BATCH)
    for i in range(5):
        h.waiter(f"chat-{i}", "chat", INTERACTIVE)
    await settle()
    # chat-0 took the headroom ahead of bulk, which is now due (1 skip) and waits for a regular
    # slot; chat-1 is admitted past it into the headroom all the same.
    assert h.order == ["chat-0", "chat-1"] and h.admitter.num_in_flight == 4
    held[0].release()
    await settle()
    assert h.order[2:] == ["chat-2"]  # in-flight 3, still past capacity: the headroom's again
    held[1].release()
    await settle()
    # Two interactive requests went past the due entry (the headroom's size): no more, or a
    # storm refilling every freed slot would keep in-flight past capacity forever.
    assert h.order[3:] == [] and h.admitter.num_in_flight == 3
    h.tasks[1].result().release()  # chat-0: in-flight 2, at capacity
    await settle()
    assert h.order[3:] == []
    h.tasks[2].result().release()  # chat-1: a regular slot frees, and the due entry gets it
    await settle()
    assert h.order[3:] == ["bulk", "chat-3", "chat-4"]
    assert h.admitter.num_in_flight == 4
    for task in h.tasks[3:]:
        task.result().release()


# --- The fair position each slot carries --------------------------------------------------------


async def test_a_slot_carries_its_tenants_fair_position(make: MakeHarness) -> None:
    h = await make(capacity=3)
    heavy = await h.admitter.admit("heavy", 1.0, STANDARD, 100, None)
    assert heavy.fair_position == 0  # nobody else is active in the band
    light = await h.admit("light")  # lifted to the floor (100), still running: counted
    assert light.fair_position == 0
    light.release()
    heavy.charge_output(50)  # heavy at 200, running; light idle (dropped at the floor)
    again = await h.admit("light")
    assert again.fair_position == 0
    more = await h.admitter.admit("heavy", 1.0, STANDARD, 10, None)
    assert more.fair_position == 1  # light, running at 110, is less served
    for slot in (heavy, again, more):
        slot.release()
