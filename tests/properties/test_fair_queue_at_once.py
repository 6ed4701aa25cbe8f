"""``FairQueue.admit_at_once`` is ``push`` then ``pop`` (hypothesis, differential).

The admitter grants a request that arrives at an empty queue in one step
(``admission/admitter.py``). Two queues take the same generated history: the reference pushes
and pops every arrival, the other admits at once each arrival that finds nothing queued. After
every step they must agree on everything the queue shows: counters, positions, floors, the
deltas a sync would share, who is popped next, and which counters were dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from admission.fair_queue import FairQueue, FairQueueConfig, QueueEntry
from admission.plans import PriorityBand
from tests.properties.profiles import examples

TENANTS = ("a", "b", "c", "d")
BANDS = tuple(PriorityBand)

_arrive = st.tuples(
    st.just("arrive"),
    st.sampled_from(TENANTS),
    st.sampled_from(BANDS),
    st.integers(0, 400),
    st.sampled_from((0.5, 1.0, 2.0, 3.0)),
    st.booleans(),
)
_other = st.tuples(st.sampled_from(("pop", "stream", "finish", "leave")), st.integers(0, 10**6))
_ops = st.lists(st.one_of(_arrive, _arrive, _other), min_size=1, max_size=80)

Pair = tuple[QueueEntry[None], QueueEntry[None]]


@dataclass
class Twins:
    """The reference queue and the one that admits at once, with their entries in pairs."""

    reference: FairQueue[None] = field(default_factory=lambda: FairQueue(FairQueueConfig()))
    at_once: FairQueue[None] = field(default_factory=lambda: FairQueue(FairQueueConfig()))
    queued: list[Pair] = field(default_factory=list)
    serving: list[Pair] = field(default_factory=list)
    admitted_at_once: int = 0

    def __post_init__(self) -> None:
        self.reference.enable_deltas()
        self.at_once.enable_deltas()

    def arrive(
        self, tenant: str, band: PriorityBand, prompt: int, weight: float, full: bool
    ) -> None:
        """``full``: no capacity, so it queues, as everything does behind a queued entry."""
        ref, fast = (QueueEntry(tenant, weight, band, prompt, 0.0, None, None) for _ in "ab")
        if full or len(self.reference):
            self.reference.push(ref)
            self.at_once.push(fast)
            self.queued.append((ref, fast))
            return
        self.reference.push(ref)
        expected = self.reference.position(tenant, band)
        assert self.reference.pop() is ref
        assert self.at_once.admit_at_once(fast) == expected
        self.serving.append((ref, fast))
        self.admitted_at_once += 1

    def pop(self, _pick: int = 0) -> None:
        if not self.queued:
            return
        ref = self.reference.pop()
        fast = self.at_once.pop()
        pair = next(p for p in self.queued if p[0] is ref)
        assert pair[1] is fast, "the two queues popped different entries"
        self.queued.remove(pair)
        self.serving.append(pair)

    def stream(self, pick: int) -> None:
        if self.serving:
            ref, fast = self.serving[pick % len(self.serving)]
            tokens = 1 + pick % 50
            self.reference.charge_output(ref.tenant_id, ref.weight, tokens)
            self.at_once.charge_output(fast.tenant_id, fast.weight, tokens)

    def finish(self, pick: int) -> None:
        if self.serving:
            ref, fast = self.serving.pop(pick % len(self.serving))
            self.reference.finish(ref)
            self.at_once.finish(fast)

    def leave(self, pick: int) -> None:
        if self.queued:
            ref, fast = self.queued.pop(pick % len(self.queued))
            assert self.reference.remove(ref)
            assert self.at_once.remove(fast)

    def assert_alike(self) -> None:
        ref, fast = self.reference, self.at_once
        assert fast.counters == ref.counters
        assert fast.take_deltas() == ref.take_deltas()
        for band in BANDS:
            assert fast.floor(band) == ref.floor(band)
            for tenant in TENANTS:
                assert fast.position(tenant, band) == ref.position(tenant, band)
        head_ref, head_fast = ref.peek(), fast.peek()
        assert (head_ref is None) == (head_fast is None)
        if head_ref is not None:
            assert any(p == (head_ref, head_fast) for p in self.queued)


@settings(max_examples=examples(300))
@given(ops=_ops)
def test_admitting_at_once_leaves_the_queue_as_a_push_and_a_pop_would(
    ops: list[tuple[object, ...]],
) -> None:
    twins = Twins()
    for op in ops:
        if op[0] == "arrive":
            _, tenant, band, prompt, weight, full = op
            twins.arrive(str(tenant), band, int(prompt), float(weight), bool(full))  # type: ignore[arg-type]
        else:
            getattr(twins, str(op[0]))(int(op[1]))  # type: ignore[call-overload]
        twins.assert_alike()


def test_the_histories_admit_at_once_and_queue_alike() -> None:
    """The property is not vacuous: a history of the kind drawn admits at once and queues."""
    twins = Twins()
    twins.arrive("a", PriorityBand.STANDARD, 10, 1.0, full=False)
    twins.arrive("b", PriorityBand.STANDARD, 10, 2.0, full=True)
    twins.arrive("c", PriorityBand.STANDARD, 10, 2.0, full=False)
    assert len(twins.queued) == 2
    twins.stream(0)
    twins.pop()
    twins.finish(0)
    twins.assert_alike()
    assert twins.admitted_at_once == 1
