"""FairQueue (VTC with priority bands): ordering, lift, weights and the VTC bound, shedding,
removal, the memory bound on counters, the starvation bound across bands, positions."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable

import pytest

from admission.fair_queue import FairQueue, FairQueueConfig, QueueEntry
from admission.plans import PriorityBand

INTERACTIVE = PriorityBand.INTERACTIVE
STANDARD = PriorityBand.STANDARD
BATCH = PriorityBand.BATCH


def entry(
    tenant: str,
    band: PriorityBand = STANDARD,
    *,
    weight: float = 1.0,
    prompt: int = 10,
    deadline: float | None = None,
    name: str = "",
) -> QueueEntry[str]:
    return QueueEntry(tenant, weight, band, prompt, 0.0, deadline, name or tenant)


def pop_names(queue: FairQueue[str], n: int) -> list[str]:
    """Pop ``n`` entries, finishing each at once, and return their payloads."""
    names = []
    for _ in range(n):
        popped = queue.pop()
        queue.finish(popped)
        names.append(popped.payload)
    return names


def test_bands_are_served_strictly_in_order() -> None:
    queue: FairQueue[str] = FairQueue()
    for band in (BATCH, STANDARD, INTERACTIVE):
        queue.push(entry(f"t-{band}", band, name=str(band)))
    assert len(queue) == 3
    assert pop_names(queue, 3) == ["interactive", "standard", "batch"]
    assert len(queue) == 0
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_smallest_counter_first_and_fifo_within_a_tenant() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(3):
        queue.push(entry("a", name=f"a{i}"))
    queue.push(entry("b", name="b0"))
    queue.charge_output("a", 1.0, 1)  # a is now ahead of b in service: b goes first
    assert pop_names(queue, 4) == ["b0", "a0", "a1", "a2"]


def test_pop_charges_prompt_and_charge_output_charges_output() -> None:
    queue: FairQueue[str] = FairQueue(FairQueueConfig(w_in=1.0, w_out=2.0))
    queue.push(entry("a", weight=2.0, prompt=100))
    popped = queue.pop()
    assert queue.counter("a") == pytest.approx(50.0)  # 1 x 100 / weight 2
    queue.charge_output("a", 2.0, 10)
    assert queue.counter("a") == pytest.approx(60.0)  # + 2 x 10 / 2
    queue.finish(popped)


def test_newcomer_is_lifted_to_the_backlog_minimum_no_banking_no_starving() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(20):
        queue.push(entry("a", name=f"a{i}"))
    pop_names(queue, 10)
    assert queue.counter("a") == pytest.approx(100.0)

    # b was idle all along: it does not get 100 tokens of head start over a (no banking)...
    queue.push(entry("b", name="b0"))
    queue.push(entry("b", name="b1"))
    assert queue.counter("b") == pytest.approx(100.0)
    # ...and is not starved behind a either: they alternate from now on.
    order = pop_names(queue, 4)
    assert sorted(order[:2]) == ["a10", "b0"]
    assert sorted(order[2:]) == ["a11", "b1"]


def test_returning_tenant_is_lifted_too() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("a"))
    for _ in range(30):
        queue.push(entry("b"))
    running = queue.pop()  # a at 10, still running (so its counter is kept), nothing queued
    pop_names(queue, 20)  # b alone is served up to 200
    queue.push(entry("a", name="a-back"))
    assert queue.counter("a") == pytest.approx(200.0)
    assert sorted(pop_names(queue, 2)) == ["a-back", "b"]  # no run of 19 a's
    queue.finish(running)


def test_lift_never_lowers_a_counter() -> None:
    queue: FairQueue[str] = FairQueue()
    for _ in range(20):
        queue.push(entry("a"))
    queue.push(entry("b", prompt=500))
    pop_names(queue, 3)  # a0, b (now at 500 and idle), a1: a stays backlogged at 20
    queue.push(entry("b", name="b-back"))
    # The floor is a's 20; b keeps its 500 and waits until a has caught up.
    assert queue.counter("b") == pytest.approx(500.0)
    assert set(pop_names(queue, 10)) == {"a"}


def test_empty_band_lifts_newcomers_to_the_last_tenant_that_left() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("a", prompt=300))
    popped = queue.pop()  # the band is empty now; a still runs
    assert queue.floor(STANDARD) == pytest.approx(300.0)
    # A brand-new tenant starts at a's counter, not at 0 (else it would overtake a for 300).
    queue.push(entry("new"))
    assert queue.counter("new") == pytest.approx(300.0)
    queue.finish(popped)


def test_lift_looks_only_at_the_same_band() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("bulk", BATCH, prompt=10_000))
    queue.push(entry("bulk", BATCH))
    queue.pop()
    assert queue.counter("bulk") == pytest.approx(10_000.0)
    queue.push(entry("chat", INTERACTIVE))
    assert queue.counter("chat") == pytest.approx(0.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_weighted_share_and_vtc_bound_for_continuously_backlogged_tenants(seed: int) -> None:
    rng = random.Random(seed)
    config = FairQueueConfig(w_in=1.0, w_out=2.0)
    queue: FairQueue[str] = FairQueue(config)
    weights = {"heavy": 2.0, "light": 1.0}
    service = dict.fromkeys(weights, 0.0)  # our own accounting, not the queue's counters
    largest_charge = 0.0  # the largest single (prompt + output) cost / weight
    for tenant, weight in weights.items():
        for _ in range(2):
            queue.push(entry(tenant, weight=weight, prompt=rng.randint(1, 200)))
    for _ in range(3000):
        popped = queue.pop()
        tenant, weight = popped.tenant_id, popped.weight
        output = rng.randint(1, 300)
        queue.charge_output(tenant, weight, output)
        queue.finish(popped)
        cost = config.w_in * popped.prompt_tokens + config.w_out * output
        service[tenant] += cost
        largest_charge = max(largest_charge, cost / weight)
        # Both tenants stay backlogged: each served request is replaced by a new one.
        queue.push(entry(tenant, weight=weight, prompt=rng.randint(1, 200)))
        gap = abs(service["heavy"] / 2.0 - service["light"] / 1.0)
        assert gap <= 2 * largest_charge
    assert service["heavy"] / service["light"] == pytest.approx(2.0, rel=0.05)


def test_shed_candidate_is_the_worst_band_then_the_largest_counter_then_newest() -> None:
    queue: FairQueue[str] = FairQueue()
    assert queue.shed_candidate() is None
    queue.push(entry("chat", INTERACTIVE))
    assert queue.shed_candidate() is not None
    queue.push(entry("small", BATCH, name="small-0"))
    queue.push(entry("big", BATCH, name="big-0"))
    queue.push(entry("big", BATCH, name="big-1"))
    queue.charge_output("big", 1.0, 100)  # big is over its share (it has requests running)
    candidate = queue.shed_candidate()
    assert candidate is not None and candidate.payload == "big-1"
    queue.remove(candidate)
    queue.remove(next(e for e in queue.entries() if e.payload == "big-0"))
    candidate = queue.shed_candidate()
    assert candidate is not None and candidate.payload == "small-0"


def test_shed_for_only_displaces_for_a_strictly_better_newcomer() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("light", STANDARD, name="light-0"))
    queue.push(entry("heavy", STANDARD, name="heavy-0"))
    queue.push(entry("heavy", STANDARD, name="heavy-1"))
    queue.charge_output("heavy", 1.0, 50)
    victim = queue.shed_for("newcomer", STANDARD)  # lifted to light's 0 < heavy's 100
    assert victim is not None and victim.payload == "heavy-1"
    assert queue.shed_for("heavy", STANDARD) is None  # never better than itself
    assert queue.shed_for("light", STANDARD) is victim  # at 0, under heavy's share
    assert queue.shed_for("anyone", BATCH) is None  # worse band
    victim = queue.shed_for("chat", INTERACTIVE)  # better band always wins
    assert victim is not None and victim.payload == "heavy-1"


def test_remove_takes_an_entry_out_without_charging() -> None:
    queue: FairQueue[str] = FairQueue()
    first, second, other = entry("a", name="a0"), entry("a", name="a1"), entry("b", name="b0")
    for e in (first, second, other):
        queue.push(e)
    assert queue.remove(second)
    assert not queue.remove(second)  # already gone
    assert len(queue) == 2
    assert queue.counter("a") == pytest.approx(0.0)
    assert sorted(pop_names(queue, 2)) == ["a0", "b0"]
    assert not queue.remove(first)  # popped


def test_expired_lists_entries_past_their_deadline() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("a", deadline=5.0, name="soon"))
    queue.push(entry("a", deadline=50.0, name="later"))
    queue.push(entry("b", deadline=None, name="never"))
    assert queue.expired(4.9) == []
    assert [e.payload for e in queue.expired(5.0)] == ["soon"]
    assert len(queue) == 3  # listing does not remove


def test_idle_counters_at_the_floor_are_dropped() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("steady", prompt=1))
    for i in range(1000):
        # A stream of one-off tenants, each served once and then gone for good...
        queue.push(entry(f"once-{i}"))
        popped = queue.pop() if i % 2 else None
        if popped is not None:
            queue.finish(popped)
        # ...while "steady" stays backlogged and keeps the floor rising.
        for _ in range(2):
            if queue.peek() is not None:
                queue.finish(queue.pop())
        queue.push(entry("steady", prompt=1))
    assert len(queue.counters) <= 3


def test_a_tenant_that_moved_band_is_dropped_from_its_new_band() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("mover", STANDARD, prompt=50))
    queue.push(entry("mover", STANDARD, prompt=50))
    queue.finish(queue.pop())  # idle in standard? no: one still queued there
    queue.push(entry("mover", BATCH, prompt=50))  # its plan changed to batch
    queue.finish(queue.pop())  # standard drained: idle there no more, still queued in batch
    queue.finish(queue.pop())  # now idle, last seen in batch
    for _ in range(10):  # batch traffic lifts the batch floor past it
        queue.push(entry("bulk", BATCH, prompt=100))
        queue.push(entry("bulk", BATCH, prompt=100))
        queue.finish(queue.pop())
    assert queue.counter("mover") is None


def test_a_running_tenant_keeps_its_counter_until_finished() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("a"))
    queue.push(entry("b"))
    running = queue.pop()
    assert running.tenant_id == "a"
    queue.push(entry("b"))
    # a is idle in the queue but still streaming: its output charges must count.
    queue.charge_output("a", 1.0, 5)
    assert queue.counter("a") == pytest.approx(20.0)
    queue.finish(running)
    with pytest.raises(ValueError, match="without a matching pop"):
        queue.finish(running)


def test_charge_output_of_a_dropped_tenant_is_ignored() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("a"))
    queue.finish(queue.pop())
    queue.push(entry("b"))  # lifted to a's 10; a is idle at the floor
    assert queue.counter("a") is None
    queue.charge_output("a", 1.0, 100)
    assert queue.counter("a") is None


def _held_bytes(run: Callable[[], None]) -> int:
    """Python memory still allocated after ``run`` (tracemalloc), beyond what it started with."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        run()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_a_queue_that_never_backs_up_holds_nothing_per_request() -> None:
    """Below capacity every request is admitted as it arrives: its heap items must go with it
    (each request left one behind, about 120 bytes, before)."""
    queue: FairQueue[str] = FairQueue()

    def serve(num_requests: int, *, at_once: bool) -> None:
        for i in range(num_requests):
            arriving = entry(f"t{i % 3}")
            if at_once:
                queue.admit_at_once(arriving)
            else:
                queue.push(arriving)
                queue.pop()
            queue.finish(arriving)

    serve(100, at_once=False)  # every tenant has its counter, every structure its size
    assert _held_bytes(lambda: serve(10_000, at_once=False)) < 16_000
    assert _held_bytes(lambda: serve(10_000, at_once=True)) < 16_000


def test_a_band_backlogged_for_long_holds_a_bounded_heap() -> None:
    """Two tenants kept queued through 10,000 pops, each charged as it streams: the stale
    heap items every charge leaves are rebuilt away, in both heaps."""
    queue: FairQueue[str] = FairQueue()
    for tenant in ("a", "b", "a", "b"):
        queue.push(entry(tenant))

    def serve(num_requests: int) -> None:
        for _ in range(num_requests):
            popped = queue.pop()
            queue.charge_output(popped.tenant_id, popped.weight, 3)
            queue.finish(popped)
            queue.push(entry(popped.tenant_id))

    serve(200)
    assert _held_bytes(lambda: serve(10_000)) < 16_000


def test_admit_at_once_is_refused_while_entries_are_queued() -> None:
    queue: FairQueue[str] = FairQueue()
    queue.push(entry("a"))
    with pytest.raises(ValueError, match="push"):
        queue.admit_at_once(entry("b"))
    assert [queued.payload for queued in queue.entries()] == ["a"]


def test_invalid_entries_are_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        entry("a", weight=0.0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        entry("a", prompt=-1)


@pytest.mark.parametrize("max_band_skips", [0, 1, 3])
def test_random_operations_keep_the_invariants(max_band_skips: int) -> None:
    """Against a plain model of the queue: the lazy heaps never pick the wrong tenant, the
    skip counts pick the right band, positions count the right tenants, and a counter is never
    dropped while its tenant has anything queued or running."""
    rng = random.Random(7)
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=max_band_skips))
    queued: list[QueueEntry[str]] = []  # the model: every queued entry, in push order
    running: list[QueueEntry[str]] = []
    skips = dict.fromkeys(PriorityBand, 0)
    tenants = [f"t{i}" for i in range(8)]
    band_of = {t: list(PriorityBand)[i % 3] for i, t in enumerate(tenants)}

    def waiting(band: PriorityBand) -> bool:
        return any(e.band is band for e in queued)

    for step in range(5000):
        op = rng.random()
        if op < 0.4:
            tenant = rng.choice(tenants)
            if rng.random() < 0.05:  # plans change now and then: a tenant moves band
                band_of[tenant] = rng.choice(list(PriorityBand))
            e = entry(tenant, band_of[tenant], prompt=rng.randint(0, 50), name=str(step))
            queue.push(e)
            queued.append(e)
        elif op < 0.65 and queued:
            before = queue.counters
            due = [b for b in PriorityBand if max_band_skips and skips[b] >= max_band_skips]
            best = min(b.rank for b in due if waiting(b)) if any(map(waiting, due)) else None
            if best is None:
                best = min(e.band.rank for e in queued)
            in_band = [e for e in queued if e.band.rank == best]
            head = queue.peek()
            assert head is not None
            active = {e.tenant_id for e in in_band + running if e.band is head.band}
            mine = before[head.tenant_id]
            expected = sum(1 for t in active - {head.tenant_id} if before[t] < mine)
            assert queue.position(head.tenant_id, head.band) == expected
            popped = queue.pop()
            assert popped is head
            assert popped.band.rank == best
            assert before[popped.tenant_id] == min(before[e.tenant_id] for e in in_band)
            assert popped is next(e for e in in_band if e.tenant_id == popped.tenant_id)
            queued.remove(popped)
            running.append(popped)
            skips[popped.band] = 0
            for band in PriorityBand:
                if band.rank > popped.band.rank and waiting(band):
                    skips[band] += 1
        elif op < 0.75 and queued:
            candidate = queue.shed_candidate()
            assert candidate is not None
            counters = queue.counters
            worst = max(e.band.rank for e in queued)
            in_band = [e for e in queued if e.band.rank == worst]
            assert candidate.band.rank == worst
            assert counters[candidate.tenant_id] == max(counters[e.tenant_id] for e in in_band)
            assert candidate is [e for e in in_band if e.tenant_id == candidate.tenant_id][-1]
            assert queue.remove(candidate)
            queued.remove(candidate)
            if not waiting(candidate.band):
                skips[candidate.band] = 0
        elif op < 0.9 and running:
            e = rng.choice(running)
            queue.charge_output(e.tenant_id, e.weight, rng.randint(1, 30))
        elif running:
            e = running.pop(rng.randrange(len(running)))
            queue.finish(e)
        assert len(queue) == len(queued)
        busy = {e.tenant_id for e in queued + running}
        assert busy <= queue.counters.keys()


# --- The starvation bound across bands ---------------------------------------------------


def pop_until(queue: FairQueue[str], payload: str, limit: int, refill: PriorityBand) -> int:
    """Pop (finishing at once, each pop replaced by a new entry of ``refill``: an endless
    stream) until ``payload`` comes out; how many pops that took. Fails past ``limit``."""
    for n in range(1, limit + 1):
        popped = queue.pop()
        queue.finish(popped)
        if popped.payload == payload:
            return n
        queue.push(entry("stream", refill))
    raise AssertionError(f"{payload} not popped in {limit} pops")


@pytest.mark.parametrize("max_band_skips", [1, 3, 8])
def test_an_endless_interactive_stream_cannot_starve_a_batch_entry(max_band_skips: int) -> None:
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=max_band_skips))
    queue.push(entry("bulk", BATCH, name="bulk"))
    for _ in range(3):
        queue.push(entry("stream", INTERACTIVE))
    # K pops go to the stream, the next one to the batch entry.
    assert pop_until(queue, "bulk", 100, INTERACTIVE) == max_band_skips + 1


def test_zero_skips_keeps_bands_strict() -> None:
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=0))
    queue.push(entry("bulk", BATCH, name="bulk"))
    queue.push(entry("stream", INTERACTIVE))
    with pytest.raises(AssertionError, match="not popped"):
        pop_until(queue, "bulk", 1000, INTERACTIVE)  # starved for as long as the stream lasts
    assert [e.payload for e in queue.entries()] == ["stream", "bulk"]


def test_max_band_skips_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_band_skips"):
        FairQueueConfig(max_band_skips=-1)


def test_the_skip_count_resets_when_the_band_is_served_or_empties() -> None:
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=3))
    queue.push(entry("stream", INTERACTIVE))
    queue.push(entry("bulk", BATCH, name="bulk-0"))
    queue.push(entry("bulk", BATCH, name="bulk-1"))
    assert pop_until(queue, "bulk-0", 10, INTERACTIVE) == 4
    # Served: bulk-1, waiting all along, starts counting afresh.
    assert pop_until(queue, "bulk-1", 10, INTERACTIVE) == 4
    # Emptied: two skips, then the entry leaves (client gone); a newcomer waits 3 skips again.
    gone = entry("bulk", BATCH, name="gone")
    queue.push(gone)
    queue.push(entry("stream", INTERACTIVE))
    queue.push(entry("stream", INTERACTIVE))
    assert pop_names(queue, 2) == ["stream", "stream"]
    assert queue.remove(gone)
    queue.push(entry("bulk", BATCH, name="bulk-2"))
    assert pop_until(queue, "bulk-2", 10, INTERACTIVE) == 4


def test_an_empty_band_does_not_count_skips() -> None:
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=2))
    for _ in range(5):
        queue.push(entry("stream", INTERACTIVE))
    pop_names(queue, 4)  # no batch entry waited through these
    queue.push(entry("bulk", BATCH, name="bulk"))
    assert pop_until(queue, "bulk", 10, INTERACTIVE) == 3


def test_due_bands_go_better_first_and_peek_shows_the_due_entry() -> None:
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=2))
    for _ in range(6):
        queue.push(entry("stream", INTERACTIVE))
    queue.push(entry("std", STANDARD, name="std"))
    queue.push(entry("bulk", BATCH, name="bulk"))
    assert pop_names(queue, 2) == ["stream", "stream"]
    head = queue.peek()  # both are due now: standard first
    assert head is not None and head.payload == "std"
    assert pop_names(queue, 3) == ["std", "bulk", "stream"]
    # Asked for a band, peek and pop give that band's VTC head regardless of who is due.
    queue.push(entry("std", STANDARD, name="std"))
    pop_names(queue, 2)
    assert queue.peek() is not None and queue.peek() is not queue.peek(INTERACTIVE)
    popped = queue.pop(INTERACTIVE)
    assert popped.band is INTERACTIVE
    queue.finish(popped)
    assert [e.payload for e in pop_names_of(queue, STANDARD)] == ["std"]


def pop_names_of(queue: FairQueue[str], band: PriorityBand) -> list[QueueEntry[str]]:
    """Pop the next entry of ``band`` (finished at once)."""
    popped = queue.pop(band)
    queue.finish(popped)
    return [popped]


def test_a_batch_tenant_alone_gets_every_pop() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(20):
        queue.push(entry("bulk", BATCH, name=f"bulk-{i}"))
    assert pop_names(queue, 20) == [f"bulk-{i}" for i in range(20)]


def test_all_tenants_interactive_keep_their_weighted_shares() -> None:
    queue: FairQueue[str] = FairQueue()
    weights = {"one": 1.0, "two": 2.0, "three": 3.0}
    for tenant, weight in weights.items():
        for _ in range(2):
            queue.push(entry(tenant, INTERACTIVE, weight=weight))
    served = dict.fromkeys(weights, 0)
    for _ in range(600):
        popped = queue.pop()
        queue.finish(popped)
        served[popped.tenant_id] += 1
        queue.push(entry(popped.tenant_id, INTERACTIVE, weight=popped.weight))
    assert served == {"one": 100, "two": 200, "three": 300}


@pytest.mark.parametrize("seed", range(40))
def test_every_backlogged_tenant_is_popped_within_the_bound(seed: int) -> None:
    """A property over random mixes of tenants, bands, weights, prompts and K: with everyone
    continuously backlogged, every band is served at least once in any K + 2 pops (the
    module's bound), and every tenant within its band's VTC turns times that."""
    rng = random.Random(seed)
    max_band_skips = rng.randint(1, 6)
    queue: FairQueue[str] = FairQueue(FairQueueConfig(max_band_skips=max_band_skips))
    tenants = {f"t{i}": (rng.choice(list(PriorityBand)), rng.choice([1.0, 2.0])) for i in range(6)}
    max_prompt = rng.randint(1, 5)
    for tenant, (band, weight) in tenants.items():
        for _ in range(2):  # two each: a tenant's queue never empties, so it is never lifted
            queue.push(entry(tenant, band, weight=weight, prompt=rng.randint(1, max_prompt)))
    # Each pop of another tenant adds at least 1/2 to its counter and it is popped only while
    # at or below ours, which it starts at most one charge (max_prompt) below.
    max_charge, min_charge = float(max_prompt), 0.5
    band_gap = max_band_skips + 2
    last_pop = {tenant: -1 for tenant in tenants}
    last_band_pop = {band: -1 for band, _ in tenants.values()}
    for n in range(2000):
        popped = queue.pop()
        queue.finish(popped)
        band = popped.band
        assert n - last_band_pop[band] <= band_gap
        others = sum(1 for b, _ in tenants.values() if b is band) - 1
        turns = others * (int(max_charge / min_charge) + 1) + 1
        assert n - last_pop[popped.tenant_id] <= turns * band_gap
        last_pop[popped.tenant_id] = last_band_pop[band] = n
        queue.push(
            entry(popped.tenant_id, band, weight=popped.weight, prompt=rng.randint(1, max_prompt))
        )
    for tenant, (band, _) in tenants.items():
        others = sum(1 for b, _ in tenants.values() if b is band) - 1
        turns = others * (int(max_charge / min_charge) + 1) + 1
        assert 2000 - last_pop[tenant] <= turns * band_gap + 1
    assert all(2000 - last <= band_gap + 1 for last in last_band_pop.values())


# --- Positions: a tenant's place in its band -------------------------------------------------


def test_position_counts_the_less_served_tenants_active_in_the_band() -> None:
    queue: FairQueue[str] = FairQueue()
    for tenant in ("low", "mid", "high"):
        queue.push(entry(tenant, name=f"{tenant}-0"))
        queue.push(entry(tenant, name=f"{tenant}-1"))
    first = [queue.pop() for _ in range(3)]  # one each, running: all at 10, one queued each
    queue.charge_output("mid", 1.0, 5)  # 20
    queue.charge_output("high", 1.0, 10)  # 30
    assert [queue.position(t, STANDARD) for t in ("low", "mid", "high")] == [0, 1, 2]
    queue.push(entry("other-band", BATCH, prompt=1))  # at 0, below everyone, in another band
    assert queue.position("low", STANDARD) == 0  # bands are never compared
    assert queue.position("other-band", BATCH) == 0

    second = queue.pop()  # low's last queued entry: low is at 20 and only running now
    assert second.payload == "low-1"
    assert queue.position("high", STANDARD) == 2  # a running tenant competes in the engine
    assert queue.position("mid", STANDARD) == 0  # low ties at 20: strictly smaller only
    for running in (first[0], second):
        queue.finish(running)  # low is idle now: no longer counted
    assert queue.position("high", STANDARD) == 1
    assert queue.position("newcomer", STANDARD) == 0  # would join at the floor (20)
    for running in first[1:]:
        queue.finish(running)
