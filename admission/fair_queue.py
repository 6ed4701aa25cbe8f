"""Weighted-fair queueing with priority bands: Virtual Token Counter (VTC, OSDI'24).

Pure policy: synchronous, no clock reads, no asyncio. The admitter owns the clock and the waiters.

- Every tenant has one virtual counter: the weighted service it received divided by its weight.
  Service costs ``w_in * prompt_tokens`` (charged when the request is admitted, ``pop``) plus
  ``w_out * output_tokens`` (charged as they stream, ``charge_output``).
- Bands come in order, with a starvation bound (``max_band_skips``, K). Each band counts the
  pops that went to a better band while it had entries waiting; once a waiting band's count
  reaches K it is *due*, and the next pop serves it (the best due band first). A band's count
  resets when it is served or empties. K = 0 keeps bands strict: a band is served only when
  every better band is empty (a steady interactive stream then starves the rest forever).
  A pop of a given band out of this order (``pop(band)``: the admitter's interactive headroom
  past a due entry) counts for no band. Bound (K >= 1, tight): a waiting band is served
  within K + 2 pops in order: K pops to better bands until it falls due, meanwhile batch may
  jump standard once (when due itself), and once batch is due a due standard goes first,
  once. Interactive is never skipped, so never due: it is served within 3 pops (due standard
  and batch first). Within a band, VTC: the backlogged
  tenant with the smallest counter goes next, FIFO per tenant, so a backlogged tenant's turn
  comes within a few of its band's turns (one per tenant ahead when charges are alike).
- Lift: when a tenant's queue in a band goes from empty to non-empty, its counter is raised to
  that band's *floor* (never lowered). The floor is the smallest counter among the tenants
  backlogged in the band, or, while the band is empty, the counter of the last tenant that
  left it (VTC's rule for an empty queue; starting newcomers at 0 instead would let them
  overtake everyone who was served before). So idle time is never banked and a newcomer is
  never starved. The lift looks only at the same band: tenants of other bands are never compared
  with it, and a batch tenant's large counter must not push an interactive newcomer ahead.
- Guarantee (the VTC bound): every counter stays within ``U_i = (w_in P_i + m_i w_out O_i) / w_i``
  of its band's floor (its largest prompt ``P_i`` and output ``O_i`` of one request, ``m_i`` its
  most requests in flight at once), since it is popped only at the floor and then charged that
  prompt and what its requests in flight still stream. So two tenants of one band, both
  continuously backlogged, gain weighted service within ``U_f + U_g`` of each other over any
  stretch: twice the largest single charge with one request in flight each, more with
  concurrency (tests/properties/test_fair_queue_properties.py checks it).
- Position (``position``): a tenant's place in its band when granted, 0 = no active tenant of
  the band (queued there, or running requests admitted from it) has received less service.
  The gateway carries it into the engine's priority, so the engine's own choices (its waiting
  queue, which request to preempt) favour the tenant most under its fair share. It counts
  running tenants too: VTC pops the smallest counter among the queued ones, so among those
  alone the granted tenant would always be 0.
- Memory: a tenant's counter is dropped once it is idle (nothing queued, nothing in service) and
  its counter is at or below its band's floor: it would be lifted to the floor on return anyway,
  and no output charge can arrive any more. The floor only rises, so a counter that is above it
  outlives its tenant's last request only until the band has served about that much more.

- Sharing across replicas (``admission.fairness_sync``): once ``enable_deltas`` is called, every
  change this queue makes to a counter is also recorded per tenant as a ``CounterDelta``, the
  function ``c -> max(c + charged, at_least)``: charges add up, lifts are normalizations (two
  replicas lifting one tenant to the same floor must not count it twice) and merge by max. A
  sync ``take_deltas``, applies them to the shared counters, and ``absorb``s the result. Counters
  only grow: a float counts whole tokens exactly up to 2**53, centuries at any real rate.

Costs: ``push``/``pop``/``charge_output`` are O(log n) over the band's backlogged tenants (lazy
heaps, rebuilt when they grow stale, emptied when the band's backlog is); ``remove`` is O(tenant
queue); ``expired`` is O(queue); ``position`` is O(the band's active tenants). An entry that
arrives while nothing is queued takes ``admit_at_once``: the push and the pop in one step,
without the heaps (the admitter's usual case, below capacity).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from admission.plans import PriorityBand

P = TypeVar("P")

# Bands from best (served first) to worst (shed first).
_BANDS = tuple(sorted(PriorityBand, key=lambda band: band.rank))

# A local counter this far (relative) above the shared value plus local changes is pushed back
# as a lift: the shared store lost it (restart, expiry). Below it, float rounding: kept quiet.
_SEED_SLACK = 1e-9

MAX_PENDING_DELTAS = 100_000
"""Deltas kept for tenants no longer tracked locally while the shared store is unreachable; past
it, theirs are dropped (they would be lifted on return anyway). Tracked tenants' are kept."""


@dataclass(frozen=True, slots=True)
class FairQueueConfig:
    """Weights of the VTC cost function (the paper charges output twice as much as prompt) and
    the starvation bound across bands."""

    w_in: float = 1.0
    """Cost of one prompt token."""
    w_out: float = 2.0
    """Cost of one output token."""
    max_band_skips: int = 8
    """Pops that may go to better bands while a band waits; the next one serves it (see the
    module docstring). 0: strict bands, a lower band waits until every better one is empty."""

    def __post_init__(self) -> None:
        if self.w_in < 0 or self.w_out < 0:
            raise ValueError("FairQueueConfig: w_in and w_out must be >= 0")
        if self.max_band_skips < 0:
            raise ValueError(
                "FairQueueConfig.max_band_skips must be >= 0 (0: strict bands), "
                f"got {self.max_band_skips}"
            )


@dataclass(frozen=True, slots=True)
class CounterDelta:
    """What one replica did to a tenant's counter since its last sync: the function
    ``c -> max(c + charged, at_least)``. Any sequence of charges (``c + x``) and lifts
    (``max(c, floor)``) composes to this form; a lift's charges before it are absorbed by it
    (they happened below the floor), its charges after it raise ``at_least`` too."""

    charged: float = 0.0
    """Sum of the charges (weighted service, always added)."""
    at_least: float | None = None
    """The counter is at least this afterwards (the highest lift, plus the charges after it);
    None when nothing was lifted."""

    def apply(self, counter: float) -> float:
        """The counter after this delta."""
        raised = counter + self.charged
        return raised if self.at_least is None else max(raised, self.at_least)

    def then(self, later: CounterDelta) -> CounterDelta:
        """This delta followed by ``later``, as one delta."""
        at_least = None if self.at_least is None else self.at_least + later.charged
        if later.at_least is not None:
            at_least = later.at_least if at_least is None else max(at_least, later.at_least)
        return CounterDelta(self.charged + later.charged, at_least)


@dataclass(slots=True, eq=False)
class QueueEntry(Generic[P]):
    """One waiting request. Compared by identity: two requests are never the same entry."""

    tenant_id: str
    weight: float
    """The tenant's fairness weight (its plan's), > 0."""
    band: PriorityBand
    prompt_tokens: int
    enqueued_at: float
    """Monotonic seconds, on the admitter's clock."""
    deadline: float | None
    """Monotonic seconds after which the request is no longer worth admitting; None: never."""
    payload: P
    """The owner's handle on the waiter (the admitter keeps the future it resolves here)."""

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"QueueEntry.weight must be > 0, got {self.weight}")
        if self.prompt_tokens < 0:
            raise ValueError(f"QueueEntry.prompt_tokens must be >= 0, got {self.prompt_tokens}")


@dataclass(slots=True)
class _Tenant:
    counter: float
    band: PriorityBand
    """The band of its latest entry: the floor its counter is compared with when idle."""
    queued: int = 0
    in_service: int = 0
    listed_in: PriorityBand | None = None
    """The band whose ``idle`` heap holds its live item; items elsewhere are stale (at most
    one live item per tenant, so the heaps stay bounded by the number of counters)."""


@dataclass(slots=True)
class _Band(Generic[P]):
    name: PriorityBand
    queues: dict[str, deque[QueueEntry[P]]] = field(default_factory=dict)
    """Backlogged tenants only: a queue is deleted when it empties."""
    num_entries: int = 0
    serving: dict[str, int] = field(default_factory=dict)
    """Requests popped from this band and not yet finished, per tenant (absent: none)."""
    num_skips: int = 0
    """Pops that went to a better band since this band was last served or empty."""
    # Lazy heaps of (counter, seq, tenant): an item is live while its tenant is backlogged here
    # and its counter is unchanged; every counter change pushes a fresh item.
    by_min: list[tuple[float, int, str]] = field(default_factory=list)
    by_max: list[tuple[float, int, str]] = field(default_factory=list)
    """Negated counters, so the heap top is the largest."""
    idle: list[tuple[float, int, str]] = field(default_factory=list)
    """Idle tenants last seen in this band, smallest counter first: candidates for dropping."""
    last_floor: float = 0.0
    """The counter of the last tenant that left this band's backlog (the floor while empty)."""


class FairQueue(Generic[P]):
    """VTC over priority bands. ``pop`` -> ``charge_output``* -> ``finish`` per admitted entry."""

    def __init__(self, config: FairQueueConfig | None = None) -> None:
        self._config = config if config is not None else FairQueueConfig()
        self._bands: dict[PriorityBand, _Band[P]] = {band: _Band(band) for band in _BANDS}
        self._tenants: dict[str, _Tenant] = {}
        self._seq = itertools.count()
        self._deltas: dict[str, CounterDelta] | None = None
        """Changes since the last ``take_deltas``; None until ``enable_deltas``."""

    def __len__(self) -> int:
        return sum(band.num_entries for band in self._bands.values())

    # -- reading ---------------------------------------------------------------------------

    def counter(self, tenant_id: str) -> float | None:
        """The tenant's virtual counter, or None when it has none (new, or dropped when idle)."""
        state = self._tenants.get(tenant_id)
        return state.counter if state is not None else None

    @property
    def counters(self) -> dict[str, float]:
        """A copy of every counter kept (for metrics and tests)."""
        return {tenant_id: state.counter for tenant_id, state in self._tenants.items()}

    def floor(self, band: PriorityBand) -> float:
        """The counter a tenant joining ``band`` now is lifted to (at least)."""
        b = self._bands[band]
        top = self._live_top(b.by_min, b, sign=1.0)
        return top[0] if top is not None else b.last_floor

    def position(self, tenant_id: str, band: PriorityBand) -> int:
        """How many other tenants active in ``band`` (queued there, or running requests popped
        from it) have a strictly smaller counter than ``tenant_id``: 0 = none is less served."""
        b = self._bands[band]
        state = self._tenants.get(tenant_id)
        mine = state.counter if state is not None else self.floor(band)
        return sum(
            1
            for other in b.queues.keys() | b.serving.keys()
            if other != tenant_id and self._tenants[other].counter < mine
        )

    def entries(self) -> Iterator[QueueEntry[P]]:
        """Every queued entry, best band first (tenants in no particular order)."""
        for band in self._bands.values():
            for queue in band.queues.values():
                yield from queue

    def expired(self, now: float) -> list[QueueEntry[P]]:
        """Entries whose deadline is at or before ``now`` (still queued: the caller removes)."""
        return [e for e in self.entries() if e.deadline is not None and e.deadline <= now]

    # -- queueing --------------------------------------------------------------------------

    def push(self, entry: QueueEntry[P]) -> None:
        """Queue ``entry`` at the back of its tenant's queue, lifting the tenant's counter to
        its band's floor if that queue was empty."""
        band = self._bands[entry.band]
        tenant_id = entry.tenant_id
        queue = band.queues.get(tenant_id)
        if queue is None:
            state = self._lifted(entry)  # before this tenant counts as backlogged here
            queue = band.queues[tenant_id] = deque()
            self._index(band, tenant_id, state.counter)
        else:
            state = self._tenants[tenant_id]  # a queued tenant always has a counter
        state.band = entry.band
        state.queued += 1
        queue.append(entry)
        band.num_entries += 1

    def peek(self, band: PriorityBand | None = None) -> QueueEntry[P] | None:
        """The entry ``pop(band)`` would return, without charging anyone."""
        if band is not None:
            return self._head(self._bands[band])
        due = self._config.max_band_skips
        for b in self._bands.values():
            if due and b.num_entries and b.num_skips >= due:
                return self._head(b)  # the best band that waited its K pops
        for b in self._bands.values():
            if b.num_entries:
                return self._head(b)
        return None

    def pop(self, band: PriorityBand | None = None) -> QueueEntry[P]:
        """Admit the next entry: the best due band, else the best band; then the smallest
        counter, FIFO per tenant. Charges its prompt; the caller must ``finish`` it when the
        request ends.

        ``band``: that band's next entry instead (interactive work admitted into the headroom
        past a due entry). Taken outside the queue's order, it is no band's turn, so it counts
        as no band's skip: otherwise those pops could make a better band due again while a due
        worse band waits for its slot, and jump it indefinitely."""
        head = self.peek()
        entry = head if band is None else self.peek(band)
        if entry is None:
            raise IndexError("pop from an empty FairQueue")
        self._take(entry)
        if entry is head:
            for b in self._bands.values():
                if b.name.rank > entry.band.rank and b.num_entries:
                    b.num_skips += 1
        self._start_service(entry, self._tenants[entry.tenant_id])
        self._left_queue(entry)
        return entry

    def admit_at_once(self, entry: QueueEntry[P]) -> int:
        """``push(entry)`` then ``pop()``, for an entry that arrives while nothing is queued in
        any band (the usual case below capacity): the same lift, charge, floors and deltas, in
        one step instead of a round trip through the band's queue and heaps. Returns the
        tenant's ``position`` in its band as it stood between the two, after its lift.
        ValueError if anything is queued: then the queue's order decides, through ``push``."""
        if len(self):
            raise ValueError("admit_at_once() with entries queued: push() and pop() instead")
        state = self._lifted(entry)
        state.band = entry.band
        position = self.position(entry.tenant_id, entry.band)
        self._start_service(entry, state)
        self._left_queue(entry)
        return position

    def remove(self, entry: QueueEntry[P]) -> bool:
        """Take a still-queued entry out (its client left, its deadline passed, it was shed).
        Nobody is charged. False when it was not queued (already popped or removed)."""
        queue = self._bands[entry.band].queues.get(entry.tenant_id)
        if queue is None or not any(e is entry for e in queue):
            return False
        self._take(entry)
        self._left_queue(entry)
        return True

    def charge_output(self, tenant_id: str, weight: float, tokens: int) -> None:
        """Charge output tokens of an admitted request as they stream. A tenant without a
        counter (only possible after ``finish``) is not charged: it is at or below the floor."""
        state = self._tenants.get(tenant_id)
        if state is None or tokens <= 0:
            return
        if not weight > 0:
            raise ValueError(f"charge_output: weight must be > 0, got {weight}")
        self._charge(tenant_id, state, self._config.w_out * tokens / weight)

    def finish(self, entry: QueueEntry[P]) -> None:
        """The popped ``entry``'s request ended: no more charges will come for it."""
        state = self._tenants.get(entry.tenant_id)
        serving = self._bands[entry.band].serving
        if state is None or state.in_service == 0 or entry.tenant_id not in serving:
            raise ValueError(f"finish() of tenant {entry.tenant_id!r} without a matching pop()")
        state.in_service -= 1
        serving[entry.tenant_id] -= 1
        if not serving[entry.tenant_id]:
            del serving[entry.tenant_id]
        self._maybe_idle(entry.tenant_id, state)

    # -- sharing counters across replicas --------------------------------------------------

    def enable_deltas(self) -> None:
        """Start recording counter changes for ``take_deltas``. Off by default: with nobody
        taking them, a lone replica would keep one per tenant ever seen. Idempotent."""
        if self._deltas is None:
            self._deltas = {}

    def take_deltas(self) -> dict[str, CounterDelta]:
        """The changes recorded since the last call, per tenant, and start afresh. Includes
        tenants whose counters were dropped since (their service still counts elsewhere)."""
        if self._deltas is None:
            raise RuntimeError("take_deltas() before enable_deltas()")
        deltas, self._deltas = self._deltas, {}
        return deltas

    def restore_deltas(self, deltas: dict[str, CounterDelta]) -> None:
        """Give back deltas that could not be shared, to go out with the next ones (they
        happened before whatever was recorded since). Bounded by ``MAX_PENDING_DELTAS``."""
        if self._deltas is None:
            raise RuntimeError("restore_deltas() before enable_deltas()")
        since = self._deltas
        merged = {
            tenant_id: delta.then(since.get(tenant_id, CounterDelta()))
            for tenant_id, delta in deltas.items()
        }
        for tenant_id, delta in since.items():
            merged.setdefault(tenant_id, delta)
        if len(merged) > MAX_PENDING_DELTAS:
            merged = {t: d for t, d in merged.items() if t in self._tenants}
        self._deltas = merged

    def absorb(self, shared: dict[str, float | None]) -> None:
        """Adopt the shared counters of tenants (read after this replica's deltas were applied to
        them): each tracked tenant's counter becomes the shared value with the changes recorded
        since ``take_deltas`` applied on top, so nothing done during the round trip is lost.

        A counter is never lowered. One above that (the store lost it: ``None`` = it has none)
        is recorded as a lift, so the next sync restores it. Untracked tenants are skipped:
        the memory bound holds, and a dropped tenant's counter comes back lifted."""
        for tenant_id, value in shared.items():
            state = self._tenants.get(tenant_id)
            if state is None:
                continue
            since = self._deltas.get(tenant_id) if self._deltas is not None else None
            target = None if value is None else since.apply(value) if since else value
            if target is not None and target > state.counter:
                self._set_counter(tenant_id, state, target)
            elif target is None or state.counter - target > _SEED_SLACK * abs(state.counter):
                self._record(tenant_id, CounterDelta(at_least=state.counter))
        for band in self._bands.values():
            self._prune(band)  # floors may have risen past idle counters

    # -- shedding --------------------------------------------------------------------------

    def shed_candidate(self) -> QueueEntry[P] | None:
        """The entry to drop first when the queue is full: worst band, then the tenant with the
        largest counter (most over its fair share), then its newest entry."""
        for band in reversed(self._bands.values()):
            top = self._live_top(band.by_max, band, sign=-1.0)
            if top is not None:
                return band.queues[top[2]][-1]
        return None

    def shed_for(self, tenant_id: str, band: PriorityBand) -> QueueEntry[P] | None:
        """The entry a newcomer of ``tenant_id`` in ``band`` displaces from a full queue, or None
        when the newcomer is not strictly better than ``shed_candidate()`` (it is shed itself).
        Better: a better band, or the same band and a smaller counter after its lift."""
        candidate = self.shed_candidate()
        if candidate is None or band.rank > candidate.band.rank:
            return None
        if band.rank < candidate.band.rank:
            return candidate
        state = self._tenants.get(tenant_id)
        newcomer = self.floor(band)
        if state is not None:
            newcomer = max(newcomer, state.counter)
        return candidate if newcomer < self._tenants[candidate.tenant_id].counter else None

    # -- internals -------------------------------------------------------------------------

    def _take(self, entry: QueueEntry[P]) -> None:
        band = self._bands[entry.band]
        queue = band.queues[entry.tenant_id]
        if queue[0] is entry:
            queue.popleft()
        else:
            queue.remove(entry)  # identity: QueueEntry compares with eq=False
        band.num_entries -= 1
        if not band.num_entries:
            band.num_skips = 0  # its wait is over: a later entry starts counting afresh
        self._tenants[entry.tenant_id].queued -= 1
        if not queue:
            del band.queues[entry.tenant_id]
            if not band.queues:
                # An item is live only while its tenant is backlogged here: none is now.
                band.by_min.clear()
                band.by_max.clear()

    def _lifted(self, entry: QueueEntry[P]) -> _Tenant:
        """The tenant of ``entry``, its counter lifted to its band's floor (made at the floor
        if it had none): VTC's rule for a tenant whose queue in the band was empty."""
        tenant_id = entry.tenant_id
        floor = self.floor(entry.band)
        state = self._tenants.get(tenant_id)
        if state is None:
            state = self._tenants[tenant_id] = _Tenant(counter=floor, band=entry.band)
            self._record(tenant_id, CounterDelta(at_least=floor))
        elif state.counter < floor:
            self._set_counter(tenant_id, state, floor)
            self._record(tenant_id, CounterDelta(at_least=floor))
        return state

    def _start_service(self, entry: QueueEntry[P], state: _Tenant) -> None:
        """``entry`` is admitted: its band was served, its request runs, its prompt is
        charged."""
        band = self._bands[entry.band]
        band.num_skips = 0
        band.serving[entry.tenant_id] = band.serving.get(entry.tenant_id, 0) + 1
        state.in_service += 1
        self._charge(entry.tenant_id, state, self._config.w_in * entry.prompt_tokens / entry.weight)

    def _head(self, band: _Band[P]) -> QueueEntry[P] | None:
        """The band's next entry: its smallest-counter tenant's oldest."""
        top = self._live_top(band.by_min, band, sign=1.0)
        return band.queues[top[2]][0] if top is not None else None

    def _left_queue(self, entry: QueueEntry[P]) -> None:
        """After ``entry`` left its queue (popped, and charged, or removed)."""
        band = self._bands[entry.band]
        state = self._tenants[entry.tenant_id]
        if not band.queues:
            # VTC's floor for an empty queue: the last tenant to leave it, as it left.
            band.last_floor = max(band.last_floor, state.counter)
        self._maybe_idle(entry.tenant_id, state)
        self._prune(band)  # its floor may have risen

    def _maybe_idle(self, tenant_id: str, state: _Tenant) -> None:
        if state.queued == 0 and state.in_service == 0 and state.listed_in is not state.band:
            self._list_idle(tenant_id, state)
        self._prune(self._bands[state.band])

    def _list_idle(self, tenant_id: str, state: _Tenant) -> None:
        state.listed_in = state.band
        item = (state.counter, next(self._seq), tenant_id)
        heapq.heappush(self._bands[state.band].idle, item)

    def _prune(self, band: _Band[P]) -> None:
        """Drop the counters of idle tenants of ``band`` that are at or below its floor."""
        floor = self.floor(band.name)
        while band.idle and band.idle[0][0] <= floor:
            _, _, tenant_id = heapq.heappop(band.idle)
            state = self._tenants.get(tenant_id)
            if state is None or state.listed_in is not band.name:
                continue  # dropped already, or listed in another band since
            state.listed_in = None
            if state.queued or state.in_service:
                continue  # busy again: listed anew when it next goes idle
            if state.band is not band.name or state.counter > floor:
                # Moved band, or charged after going idle: list it where it stands now.
                self._list_idle(tenant_id, state)
            else:
                del self._tenants[tenant_id]

    def _charge(self, tenant_id: str, state: _Tenant, amount: float) -> None:
        self._set_counter(tenant_id, state, state.counter + amount)
        if amount:
            self._record(tenant_id, CounterDelta(charged=amount))

    def _record(self, tenant_id: str, delta: CounterDelta) -> None:
        if self._deltas is not None:
            earlier = self._deltas.get(tenant_id)
            self._deltas[tenant_id] = earlier.then(delta) if earlier is not None else delta

    def _set_counter(self, tenant_id: str, state: _Tenant, value: float) -> None:
        state.counter = value
        for band in self._bands.values():
            if tenant_id in band.queues:
                self._index(band, tenant_id, value)

    def _index(self, band: _Band[P], tenant_id: str, counter: float) -> None:
        seq = next(self._seq)
        heapq.heappush(band.by_min, (counter, seq, tenant_id))
        heapq.heappush(band.by_max, (-counter, seq, tenant_id))
        # Stale items pile up with every charge; rebuild once they outnumber the live ones.
        # Both heaps count: a counter only grows, so a tenant's stale items sink to the bottom
        # of ``by_max``, where no look at its top ever pops them, while ``by_min`` sheds its
        # own at every look (``floor``).
        if len(band.by_min) + len(band.by_max) > 4 * len(band.queues) + 128:
            live = [(self._tenants[t].counter, next(self._seq), t) for t in band.queues]
            band.by_min = live
            band.by_max = [(-c, s, t) for c, s, t in live]
            heapq.heapify(band.by_min)
            heapq.heapify(band.by_max)

    def _live_top(
        self, heap: list[tuple[float, int, str]], band: _Band[P], sign: float
    ) -> tuple[float, int, str] | None:
        """The heap's top after discarding stale items, with the counter's sign restored."""
        while heap:
            key, seq, tenant_id = heap[0]
            state = self._tenants.get(tenant_id)
            if tenant_id in band.queues and state is not None and state.counter == sign * key:
                return sign * key, seq, tenant_id
            heapq.heappop(heap)
        return None
