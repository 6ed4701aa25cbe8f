"""FairQueue's side of sharing counters across replicas: deltas (charges add, lifts merge by
max), absorbing shared counters without losing what happened during the round trip, and the
memory bound with deltas on."""

from __future__ import annotations

import random

import pytest

from admission.fair_queue import MAX_PENDING_DELTAS, CounterDelta, FairQueue, QueueEntry
from admission.plans import PriorityBand

STANDARD = PriorityBand.STANDARD


def entry(
    tenant: str,
    band: PriorityBand = STANDARD,
    *,
    prompt: int = 10,
    name: str = "",
) -> QueueEntry[str]:
    return QueueEntry(tenant, 1.0, band, prompt, 0.0, None, name or tenant)


def sharing_queue() -> FairQueue[str]:
    queue: FairQueue[str] = FairQueue()
    queue.enable_deltas()
    return queue


def serve(queue: FairQueue[str], tenant: str, prompt: int) -> None:
    """One request of ``tenant``, admitted and finished at once."""
    queue.push(entry(tenant, prompt=prompt))
    queue.finish(queue.pop())


def pop_names(queue: FairQueue[str], n: int) -> list[str]:
    names = []
    for _ in range(n):
        popped = queue.pop()
        queue.finish(popped)
        names.append(popped.payload)
    return names


def test_deltas_are_recorded_only_once_enabled() -> None:
    queue: FairQueue[str] = FairQueue()
    with pytest.raises(RuntimeError, match="enable_deltas"):
        queue.take_deltas()
    serve(queue, "early", 50)
    queue.enable_deltas()
    assert queue.take_deltas() == {}
    queue.push(entry("a", prompt=30))
    running = queue.pop()
    queue.charge_output("a", 1.0, 5)
    # Created at the empty band's floor (early's 50), then charged 30 + 2 x 5.
    assert queue.take_deltas() == {"a": CounterDelta(charged=40.0, at_least=90.0)}
    assert queue.take_deltas() == {}  # taken means reset
    queue.finish(running)


def test_a_delta_composes_charges_and_lifts_exactly() -> None:
    charge_10, lift_100, charge_5 = (
        CounterDelta(charged=10.0),
        CounterDelta(at_least=100.0),
        CounterDelta(charged=5.0),
    )
    composed = charge_10.then(lift_100).then(charge_5)
    for start in (0.0, 50.0, 90.0, 95.0, 200.0):
        step_by_step = max(start + 10.0, 100.0) + 5.0
        assert composed.apply(start) == pytest.approx(step_by_step)
    # A lift absorbs the charges before it: not max(c, 100) + 15, which over-charges by 10.
    assert composed.apply(0.0) == pytest.approx(105.0)


def test_lifts_from_two_replicas_merge_by_max_while_charges_add() -> None:
    replicas = [sharing_queue(), sharing_queue()]
    for queue in replicas:
        serve(queue, "other", 100)  # each replica's band floor is now 100
        serve(queue, "a", 7)  # a newcomer: lifted to 100, charged 7
    shared = 0.0
    for queue in replicas:
        shared = queue.take_deltas()["a"].apply(shared)
    # Two lifts to 100 count once; the two charges of 7 both count.
    assert shared == pytest.approx(114.0)


def test_the_composed_delta_matches_the_counter_under_random_operations() -> None:
    """Whatever the queue does (charges, lifts, drops and re-creations), each tracked tenant's
    counter equals its delta applied to its counter when the deltas were taken (0 if new).
    Each tenant keeps its band (its plan's): a band's floor only rises, so a dropped tenant
    returns at or above its old counter (moving to a band with a lower floor, it would not)."""
    rng = random.Random(11)
    queue = sharing_queue()
    running: list[QueueEntry[str]] = []
    tenants = [f"t{i}" for i in range(12)]
    band_of = {t: list(PriorityBand)[i % 3] for i, t in enumerate(tenants)}
    taken_at: dict[str, float] = {}
    num_lifts = num_drops = 0
    for step in range(4000):
        if step % 50 == 0:
            deltas = queue.take_deltas()
            for tenant_id, counter in queue.counters.items():
                assert deltas.get(tenant_id, CounterDelta()).apply(
                    taken_at.get(tenant_id, 0.0)
                ) == pytest.approx(counter)
            taken_at = queue.counters
        tracked = queue.counters.keys()
        op = rng.random()
        if op < 0.3:
            tenant = rng.choice(tenants)
            before = queue.counter(tenant)
            queue.push(entry(tenant, band_of[tenant], prompt=rng.randint(0, 40), name=str(step)))
            after = queue.counter(tenant)
            num_lifts += before is not None and after is not None and after > before
        elif op < 0.6 and len(queue):
            running.append(queue.pop())
        elif op < 0.75 and running:
            e = rng.choice(running)
            queue.charge_output(e.tenant_id, e.weight, rng.randint(1, 20))
        elif running:
            queue.finish(running.pop(rng.randrange(len(running))))
        num_drops += not tracked <= queue.counters.keys()
    assert num_lifts > 10 and num_drops > 10, (
        num_lifts,
        num_drops,
    )  # the mix exercised what the claim is about


def test_a_charge_during_the_round_trip_survives_absorb() -> None:
    queue = sharing_queue()
    queue.push(entry("a", prompt=100))
    running = queue.pop()
    deltas = queue.take_deltas()  # sent to the store...
    queue.charge_output("a", 1.0, 10)  # ...while a's stream goes on: +20
    # The store applied our 100 on top of 400 a received through other replicas.
    shared = deltas["a"].apply(400.0)
    queue.absorb({"a": shared})
    assert queue.counter("a") == pytest.approx(520.0)
    # The charge made during the round trip is still pending, to be sent next.
    assert queue.take_deltas() == {"a": CounterDelta(charged=20.0)}
    queue.finish(running)


def test_absorb_reorders_dispatch() -> None:
    queue = sharing_queue()
    for i in range(3):
        queue.push(entry("a", name=f"a{i}"))
        queue.push(entry("b", name=f"b{i}"))
    assert queue.peek() is not None and queue.peek().payload == "a0"  # type: ignore[union-attr]
    queue.take_deltas()
    queue.absorb({"a": 1000.0, "b": 5.0})  # a was served elsewhere; b barely
    assert queue.counter("a") == pytest.approx(1000.0)
    assert pop_names(queue, 3) == ["b0", "b1", "b2"]
    assert pop_names(queue, 3) == ["a0", "a1", "a2"]


def test_absorb_never_lowers_a_counter_and_pushes_it_back_when_the_store_lost_it() -> None:
    queue = sharing_queue()
    queue.push(entry("a", prompt=300))
    running = queue.pop()  # a at 300, tracked while running
    queue.take_deltas()
    queue.absorb({"a": 300.0 + 1e-12})  # float noise: adopted, nothing to push back
    assert queue.take_deltas() == {}
    queue.absorb({"a": 10.0})  # the store restarted and has only a's latest charges
    assert queue.counter("a") == pytest.approx(300.0)
    assert queue.take_deltas() == {"a": CounterDelta(at_least=pytest.approx(300.0))}
    queue.absorb({"a": None})  # the store has nothing (restarted, or expired)
    assert queue.counter("a") == pytest.approx(300.0)
    assert queue.take_deltas() == {"a": CounterDelta(at_least=pytest.approx(300.0))}
    queue.finish(running)


def test_absorb_ignores_untracked_tenants_and_a_dropped_tenant_returns_lifted() -> None:
    queue = sharing_queue()
    queue.push(entry("steady"))
    queue.absorb({"ghost": 50.0})  # a stale read of a tenant this replica does not track
    assert queue.counter("ghost") is None

    serve(queue, "a", 10)
    pop_names(queue, 1)  # steady served: the band's floor passes a's 10, a is dropped
    assert queue.counter("a") is None
    queue.take_deltas()
    queue.push(entry("a"))  # back: lifted to the local floor...
    assert queue.counter("a") == pytest.approx(10.0)
    queue.absorb({"a": queue.take_deltas()["a"].apply(700.0)})  # ...then its shared counter
    assert queue.counter("a") == pytest.approx(700.0)


def test_idle_counters_are_still_dropped_with_deltas_on() -> None:
    queue = sharing_queue()
    queue.push(entry("steady", prompt=1))
    max_deltas = 0
    for i in range(1000):
        serve(queue, f"once-{i}", 10)  # a stream of one-off tenants
        for _ in range(2):
            if queue.peek() is not None:
                queue.finish(queue.pop())
        queue.push(entry("steady", prompt=1))
        if i % 10 == 9:  # a sync every ten requests, the store adding a little
            deltas = queue.take_deltas()
            max_deltas = max(max_deltas, len(deltas))
            queue.absorb({t: deltas.get(t, CounterDelta()).apply(1.0) for t in queue.counters})
    assert len(queue.counters) <= 3
    assert max_deltas <= 12  # only the tenants active since the last sync


def test_restored_deltas_go_before_the_ones_recorded_since() -> None:
    queue = sharing_queue()
    queue.push(entry("a", prompt=100))
    running = queue.pop()
    failed = queue.take_deltas()  # (100, at least 100): the store was down
    queue.charge_output("a", 1.0, 5)  # +10 meanwhile
    queue.restore_deltas(failed)
    pending = queue.take_deltas()
    assert pending == {"a": CounterDelta(charged=110.0, at_least=110.0)}
    assert pending["a"].apply(0.0) == pytest.approx(queue.counter("a") or 0.0)
    queue.finish(running)


def test_pending_deltas_of_untracked_tenants_are_bounded() -> None:
    queue = sharing_queue()
    queue.push(entry("tracked", prompt=5))
    queue.pop()
    failed = queue.take_deltas()
    failed.update({f"gone-{i}": CounterDelta(charged=1.0) for i in range(MAX_PENDING_DELTAS)})
    queue.restore_deltas(failed)
    assert queue.take_deltas() == {"tracked": CounterDelta(charged=5.0, at_least=5.0)}
    few = {f"gone-{i}": CounterDelta(charged=1.0) for i in range(10)}
    queue.restore_deltas(few)  # under the bound: kept, they still count elsewhere
    assert queue.take_deltas() == few
