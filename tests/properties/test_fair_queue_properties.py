"""Properties of the fair queue over generated histories (hypothesis).

**The VTC bound** (Sheng et al., "Fairness in Serving Large Language Models", OSDI '24, adapted
to Tandem's charges; docs/ARCHITECTURE.md, "Tenants, quotas and fairness", states it). Let
``S_i`` be tenant ``i``'s service: ``w_in x prompt`` at each pop plus ``w_out x output`` as
charged. For two tenants ``f`` and ``g`` of one band, both continuously backlogged (requests
queued) over a stretch of the history, the weighted services gained in it differ by at most

    |dS_f / w_f - dS_g / w_g| <= U_f + U_g,   U_i = (w_in P_i + m_i w_out O_i) / w_i

where ``P_i`` and ``O_i`` are ``i``'s largest prompt and largest output of one request, and
``m_i`` the most requests ``i`` had in flight at once. Why: a band's floor (its smallest
backlogged counter) never decreases; a tenant is popped only at the floor, and after its last
pop its counter grows by that prompt and the rest of what its requests in flight then still
stream; so every counter is at most its band's floor plus ``U_i``, while a backlogged one is at
least the floor. Over a stretch with no lift a backlogged tenant's counter grows by exactly
``dS_i / w_i``; the two ends give ``U_f`` and ``U_g``. With one request in flight per tenant
(``m = 1``) this is VTC's "twice the largest single charge"; concurrency multiplies the output
part, since output is charged as it streams, after the pop. It is the constant, not a loose
cover: generated histories come within 4 % of it with both tenants served and several requests
in flight (and reach it when one of them was not served yet).

The bound holds whatever decides *when* to pop and from which band (capacity, headroom, due
bands): within a band a pop always takes the smallest counter. So the first property drives the
pure ``FairQueue`` with arbitrary schedules; the second runs the real ``Admitter`` (asyncio, a
fake clock) and adds the starvation bound across bands and work conservation.

**The starvation bound** (``admission/admitter.py``): while a band has requests waiting, at
most ``K + 1 + 2h`` admissions go to other bands (``K`` = ``max_band_skips`` >= 1, ``h`` the
headroom's slots, ``ceil(capacity x interactive_headroom)``); interactive work waits through at
most 2 (a due standard, then a due batch), none with strict bands (``K`` = 0). It found a batch
request starved forever (``starving_batch``, fixed in ``FairQueue.pop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from dataclasses import dataclass, field
from typing import Literal

from hypothesis import example, given, settings, target
from hypothesis import strategies as st

from admission.admitter import AdmissionConfig, AdmissionSlot, Admitter
from admission.fair_queue import FairQueue, FairQueueConfig, QueueEntry
from admission.plans import PriorityBand
from tests.properties.profiles import examples

WEIGHTS = (0.5, 1.0, 2.0, 3.0)
TOLERANCE = 1e-6
"""Float slack on the bound (counters are sums of fractions of whole tokens)."""

Op = Literal["arrive", "pop", "stream", "finish", "leave"]
OPS: tuple[Op, ...] = ("arrive", "pop", "stream", "finish", "leave")
AdmitterEntry = QueueEntry["asyncio.Future[AdmissionSlot]"]


# --- Scenarios --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantPlan:
    """One tenant of a scenario: its plan, its requests, and when it keeps some queued."""

    name: str
    band: PriorityBand
    weight: float
    sizes: tuple[tuple[int, int], ...]
    """(prompt, output) of its requests, in turn."""
    start: int
    pause_at: int
    pause_steps: int
    depth: int
    """Requests it keeps queued while active."""

    def depth_at(self, step: int) -> int:
        """How many requests it keeps queued at ``step``: ``depth`` from ``start`` on, except
        during one pause. So newcomers join a band that served others for a while, and
        returning tenants find a risen floor (what the lift is for)."""
        paused = self.pause_at <= step < self.pause_at + self.pause_steps
        return self.depth if self.start <= step and not paused else 0


@dataclass(frozen=True, slots=True)
class Scenario:
    config: FairQueueConfig
    capacity: int
    """Requests in flight at most (the bound grows with them)."""
    tenants: tuple[TenantPlan, ...]
    steps: tuple[tuple[Op, int], ...]
    """One operation per step, and a number choosing its target (``pick``)."""


def pick(choice: int, options: int) -> int:
    return choice % options


@st.composite
def scenarios(draw: st.DrawFn, max_steps: int = 150) -> Scenario:
    config = FairQueueConfig(
        w_in=1.0,
        w_out=draw(st.sampled_from([1.0, 2.0, 3.0])),
        max_band_skips=draw(st.integers(0, 4)),
    )
    num_steps = draw(st.integers(30, max_steps))
    # One band (every pair is compared), or every band (what the starvation bound is about).
    if draw(st.booleans()):
        num_tenants = draw(st.integers(2, 5))
        bands = [PriorityBand.STANDARD] * num_tenants
    else:
        num_tenants = draw(st.integers(3, 5))
        bands = [*PriorityBand, *(draw(st.sampled_from(list(PriorityBand))) for _ in range(2))]
    # Staggered: each tenant starts a while after the one before, into a band that has served
    # the others for that long.
    gaps = [0] + [draw(st.integers(0, num_steps // num_tenants)) for _ in range(num_tenants - 1)]
    tenants = tuple(
        TenantPlan(
            name=f"t{i}",
            band=bands[i],
            weight=draw(st.sampled_from(WEIGHTS)),
            sizes=tuple(
                draw(
                    st.lists(
                        st.tuples(st.integers(0, 300), st.integers(1, 300)),
                        min_size=1,
                        max_size=4,
                    )
                )
            ),
            start=start,
            pause_at=start + draw(st.integers(0, num_steps // 2)),
            pause_steps=draw(st.integers(0, num_steps // 2)),
            depth=draw(st.integers(1, 3)),
        )
        for i, start in enumerate(itertools.accumulate(gaps))
    )
    # How often each operation comes, per example: backlogs build up or drain.
    mix = [
        op for op in OPS for _ in range(draw(st.integers(0 if op in ("arrive", "leave") else 1, 3)))
    ]
    steps = draw(
        st.lists(
            st.tuples(st.sampled_from(mix), st.integers(0, 2**16)),
            min_size=num_steps,
            max_size=num_steps,
        )
    )
    return Scenario(config, draw(st.integers(1, 4)), tenants, tuple(steps))


# --- What the test measures -------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class Request:
    """A request's life as the test sees it (the queue's payload). Compared by identity."""

    tenant: TenantPlan
    prompt: int
    output: int
    """Output tokens it will stream in all."""
    streamed: int = 0


@dataclass(slots=True)
class TenantStats:
    """What the test measures of one tenant, independently of the queue's counters."""

    service: float = 0.0
    largest_prompt: int = 0
    largest_output: int = 0
    in_flight: int = 0
    most_in_flight: int = 0
    queued: int = 0
    arrived: int = 0

    def bound_part(self, config: FairQueueConfig, weight: float) -> float:
        """``U_i`` of the module docstring, from what happened so far."""
        prompt = config.w_in * self.largest_prompt
        output = self.most_in_flight * config.w_out * self.largest_output
        return (prompt + output) / weight


@dataclass(slots=True)
class PairWindow:
    """The extremes of ``S_f / w_f - S_g / w_g`` since both became backlogged."""

    low: float
    high: float


@dataclass
class VtcChecker:
    """Measures service and checks the VTC bound after every change, for every pair of
    tenants of one band."""

    config: FairQueueConfig
    tenants: tuple[TenantPlan, ...]
    stats: dict[str, TenantStats] = field(default_factory=dict)
    windows: dict[tuple[str, str], PairWindow] = field(default_factory=dict)
    largest_ratio: float = 0.0
    """How close any pair came to its bound (for ``target``)."""

    def __post_init__(self) -> None:
        self.stats = {t.name: TenantStats() for t in self.tenants}

    def new_request(self, tenant: TenantPlan) -> Request:
        stats = self.stats[tenant.name]
        prompt, output = tenant.sizes[stats.arrived % len(tenant.sizes)]
        stats.arrived += 1
        return Request(tenant, prompt, output)

    def queued(self, request: Request) -> None:
        self.stats[request.tenant.name].queued += 1
        self.check()

    def left(self, request: Request) -> None:
        """Left the queue unserved (its client left, its deadline passed, it was shed)."""
        self.stats[request.tenant.name].queued -= 1
        self.check()

    def popped(self, request: Request) -> None:
        stats = self.stats[request.tenant.name]
        stats.queued -= 1
        stats.service += self.config.w_in * request.prompt
        stats.largest_prompt = max(stats.largest_prompt, request.prompt)
        stats.in_flight += 1
        stats.most_in_flight = max(stats.most_in_flight, stats.in_flight)
        self.check()

    def streamed(self, request: Request, tokens: int) -> None:
        request.streamed += tokens
        stats = self.stats[request.tenant.name]
        stats.service += self.config.w_out * tokens
        stats.largest_output = max(stats.largest_output, request.streamed)
        self.check()

    def finished(self, request: Request) -> None:
        self.stats[request.tenant.name].in_flight -= 1

    def check(self) -> None:
        """After each change of one tenant's queue or service, so a tenant's queue never
        empties and refills between two checks: a lift always ends its windows."""
        for f, g in itertools.combinations(self.tenants, 2):
            key = (f.name, g.name)
            sf, sg = self.stats[f.name], self.stats[g.name]
            if f.band is not g.band or not sf.queued or not sg.queued:
                self.windows.pop(key, None)
                continue
            gap = sf.service / f.weight - sg.service / g.weight
            window = self.windows.setdefault(key, PairWindow(gap, gap))
            window.low, window.high = min(window.low, gap), max(window.high, gap)
            bound = sf.bound_part(self.config, f.weight) + sg.bound_part(self.config, g.weight)
            spread = window.high - window.low
            if bound > 0:
                self.largest_ratio = max(self.largest_ratio, spread / bound)
            assert spread <= bound + TOLERANCE, (
                f"VTC bound broken: tenants {f.name} (weight {f.weight}) and {g.name} (weight "
                f"{g.weight}) of band {f.band}, both backlogged all along, drifted apart by "
                f"{spread:.3f} weighted tokens, more than U_f + U_g = {bound:.3f} "
                f"(stats {sf} / {sg})"
            )


# --- The pure queue under any schedule --------------------------------------------------------


@settings(max_examples=examples(200))
@given(scenarios())
def test_vtc_bound_holds_under_any_schedule(scenario: Scenario) -> None:
    """Arrivals, pops (from any band: the schedule is free, within a capacity), output charged
    in any chunks, finishes and removals in any order: every pair of continuously backlogged
    tenants of one band stays within the VTC bound."""
    queue: FairQueue[Request] = FairQueue(scenario.config)
    checker = VtcChecker(scenario.config, scenario.tenants)
    queued: list[QueueEntry[Request]] = []
    running: list[QueueEntry[Request]] = []

    def arrive(tenant: TenantPlan) -> None:
        request = checker.new_request(tenant)
        entry = QueueEntry(
            tenant.name, tenant.weight, tenant.band, request.prompt, 0.0, None, request
        )
        queue.push(entry)
        queued.append(entry)
        checker.queued(request)

    for step, (op, choice) in enumerate(scenario.steps):
        for tenant in scenario.tenants:
            while checker.stats[tenant.name].queued < tenant.depth_at(step):
                arrive(tenant)
        if op == "arrive":
            arrive(scenario.tenants[pick(choice, len(scenario.tenants))])
        elif op == "pop" and queued and len(running) < scenario.capacity:
            bands = sorted({e.band for e in queued}, key=lambda b: b.rank)
            options: list[PriorityBand | None] = [None, *bands]
            popped = queue.pop(options[pick(choice, len(options))])
            queued.remove(popped)
            running.append(popped)
            checker.popped(popped.payload)
        elif op == "stream" and running:
            entry = running[pick(choice, len(running))]
            left = entry.payload.output - entry.payload.streamed
            if left:
                tokens = 1 + pick(choice // 7, left)
                queue.charge_output(entry.tenant_id, entry.weight, tokens)
                checker.streamed(entry.payload, tokens)
        elif op == "finish" and running:
            entry = running.pop(pick(choice, len(running)))
            queue.finish(entry)
            checker.finished(entry.payload)
        elif op == "leave" and queued:
            entry = queued.pop(pick(choice, len(queued)))
            assert queue.remove(entry)
            checker.left(entry.payload)
        assert len(queue) == len(queued)
    target(checker.largest_ratio, label="largest drift / VTC bound")


# --- The real admitter ------------------------------------------------------------------------


class FakeClock:
    """The admitter's clock: it never moves (deadlines are not what this checks)."""

    def __call__(self) -> float:
        return 1_000.0


def starvation_bound(band: PriorityBand, config: FairQueueConfig, headroom: int) -> int | None:
    """The most admissions of other bands while ``band`` has requests waiting (docs/
    ARCHITECTURE.md states it); None: unbounded (strict bands, ``max_band_skips`` 0)."""
    skips = config.max_band_skips
    if band is PriorityBand.INTERACTIVE:
        return 2 if skips else 0  # a due standard, then a due batch
    return skips + 1 + 2 * headroom if skips else None


@dataclass
class AdmitterRun:
    """One scenario through a real ``Admitter``: requests are asyncio tasks waiting in
    ``admit``; a spy on its fair queue sees every push, pop and removal, in order."""

    scenario: Scenario
    headroom: float
    admitter: Admitter = field(init=False)
    checker: VtcChecker = field(init=False)
    requests: dict[int, Request] = field(default_factory=dict)
    """Queue entry (by identity) -> its request."""
    arriving: Request | None = None
    waiting: dict[Request, asyncio.Task[AdmissionSlot]] = field(default_factory=dict)
    running: list[tuple[Request, AdmissionSlot]] = field(default_factory=list)
    queued_by_band: dict[PriorityBand, int] = field(default_factory=dict)
    others_served: dict[PriorityBand, int] = field(default_factory=dict)
    """Admissions of other bands since the band last had nothing waiting or was served."""
    longest_wait_ratio: float = 0.0
    """The most ``others_served`` seen over its bound (for ``target``)."""

    def __post_init__(self) -> None:
        self.admitter = Admitter(
            AdmissionConfig(
                max_queue=10_000,
                max_in_flight=self.scenario.capacity,
                default_queue_timeout_s=1e9,
                interactive_headroom=self.headroom,
            ),
            fair=self.scenario.config,
            clock=FakeClock(),
        )
        self.checker = VtcChecker(self.scenario.config, self.scenario.tenants)
        self.queued_by_band = dict.fromkeys(PriorityBand, 0)
        self.others_served = dict.fromkeys(PriorityBand, 0)
        queue = self.admitter.fair_queue
        push, pop, remove = queue.push, queue.pop, queue.remove
        admit_at_once = queue.admit_at_once

        def spy_push(entry: AdmitterEntry) -> None:
            push(entry)
            self.arrived(entry)

        def spy_admit_at_once(entry: AdmitterEntry) -> int:
            # A push and a pop in one step (tests/properties/test_fair_queue_at_once.py).
            in_flight = self.admitter.num_in_flight
            position = admit_at_once(entry)
            self.arrived(entry)
            self.admitted(entry, in_flight)
            return position

        def spy_pop(band: PriorityBand | None = None) -> AdmitterEntry:
            in_flight = self.admitter.num_in_flight  # before this admission counts
            entry = pop(band)
            self.admitted(entry, in_flight)
            return entry

        def spy_remove(entry: AdmitterEntry) -> bool:
            removed = remove(entry)
            if removed:
                self.queued_by_band[entry.band] -= 1
                if not self.queued_by_band[entry.band]:
                    self.others_served[entry.band] = 0
                self.checker.left(self.requests[id(entry)])
            return removed

        queue.push = spy_push  # type: ignore[method-assign]
        queue.admit_at_once = spy_admit_at_once  # type: ignore[method-assign]
        queue.pop = spy_pop  # type: ignore[method-assign]
        queue.remove = spy_remove  # type: ignore[method-assign]

    @property
    def headroom_slots(self) -> int:
        return math.ceil(self.scenario.capacity * self.headroom)

    def arrived(self, entry: AdmitterEntry) -> None:
        assert self.arriving is not None
        self.requests[id(entry)] = self.arriving
        self.queued_by_band[entry.band] += 1
        self.checker.queued(self.arriving)

    def admitted(self, entry: AdmitterEntry, in_flight: int) -> None:
        capacity = self.scenario.capacity
        if entry.band is PriorityBand.INTERACTIVE:
            assert in_flight < capacity + self.headroom_slots, "interactive past the headroom"
        else:
            assert in_flight < capacity, f"{entry.band} admitted past the capacity"
        self.queued_by_band[entry.band] -= 1
        for band, num_queued in self.queued_by_band.items():
            if band is entry.band or not num_queued:
                self.others_served[band] = 0
                continue
            self.others_served[band] += 1
            bound = starvation_bound(band, self.scenario.config, self.headroom_slots)
            if bound:
                ratio = self.others_served[band] / bound
                self.longest_wait_ratio = max(self.longest_wait_ratio, ratio)
            assert bound is None or self.others_served[band] <= bound, (
                f"band {band} waited through {self.others_served[band]} admissions of other "
                f"bands, more than its bound {bound} (max_band_skips "
                f"{self.scenario.config.max_band_skips}, capacity {capacity}, headroom "
                f"{self.headroom_slots})"
            )
        self.checker.popped(self.requests.pop(id(entry)))

    async def arrive(self, tenant: TenantPlan) -> None:
        request = self.checker.new_request(tenant)
        self.arriving = request
        self.waiting[request] = asyncio.create_task(
            self.admitter.admit(tenant.name, tenant.weight, tenant.band, request.prompt, None)
        )
        await self.settle()
        self.arriving = None

    async def settle(self) -> None:
        """Run the waiters until each is admitted or waits in the queue."""
        for _ in range(100):
            await asyncio.sleep(0)
            for request, task in list(self.waiting.items()):
                if task.done():
                    del self.waiting[request]
                    self.running.append((request, task.result()))
            if len(self.waiting) == self.admitter.num_queued:
                break
        assert len(self.waiting) == self.admitter.num_queued, "a request is neither queued nor in"
        if self.admitter.num_queued:
            # Capacity never idles while a request waits.
            assert self.admitter.num_in_flight >= self.scenario.capacity

    async def leave(self, choice: int) -> None:
        request = list(self.waiting)[pick(choice, len(self.waiting))]
        task = self.waiting.pop(request)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await self.settle()

    async def finish(self, choice: int) -> None:
        request, slot = self.running.pop(pick(choice, len(self.running)))
        self.checker.finished(request)
        slot.release()
        await self.settle()

    def stream(self, choice: int) -> None:
        request, slot = self.running[pick(choice, len(self.running))]
        left = request.output - request.streamed
        if left:
            tokens = 1 + pick(choice // 7, left)
            slot.charge_output(tokens)
            self.checker.streamed(request, tokens)

    async def aclose(self) -> None:
        for task in self.waiting.values():
            task.cancel()
        await asyncio.gather(*self.waiting.values(), return_exceptions=True)


def starving_batch() -> Scenario:
    """The history of the starvation bug (fixed): interactive and standard keep two requests
    queued, batch waits, with one slot of capacity and one of headroom; requests just finish.
    Batch waited through every admission (a due standard took each regular slot, made due
    again by the headroom's pops)."""
    tenants = tuple(
        TenantPlan(f"t{i}", band, 1.0, ((1, 1),), start=0, pause_at=0, pause_steps=0, depth=2)
        for i, band in enumerate(PriorityBand)
    )
    config = FairQueueConfig(max_band_skips=1)
    return Scenario(config, capacity=1, tenants=tenants, steps=(("finish", 0),) * 12)


@settings(max_examples=examples(100))
@given(scenario=scenarios(), headroom=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
@example(scenario=starving_batch(), headroom=1.0)
async def test_admitter_keeps_the_vtc_and_starvation_bounds_and_never_idles(
    scenario: Scenario, headroom: float
) -> None:
    """The same histories through the real ``Admitter``: it pops when capacity frees (and into
    the interactive headroom), so besides the VTC bound: no band waits through more other
    admissions than its starvation bound, no admission passes the capacity (plus headroom
    for interactive work), and capacity never idles while a request waits."""
    run = AdmitterRun(scenario, headroom)
    try:
        for step, (op, choice) in enumerate(scenario.steps):
            for tenant in scenario.tenants:
                while run.checker.stats[tenant.name].queued < tenant.depth_at(step):
                    await run.arrive(tenant)
            if op == "arrive":
                await run.arrive(scenario.tenants[pick(choice, len(scenario.tenants))])
            elif op == "stream" and run.running:
                run.stream(choice)
            elif op in ("finish", "pop") and run.running:
                await run.finish(choice)  # the admitter pops by itself when a slot frees
            elif op == "leave" and run.waiting:
                await run.leave(choice)
    finally:
        await run.aclose()
    target(run.checker.largest_ratio, label="largest drift / VTC bound")
    target(run.longest_wait_ratio, label="longest wait / starvation bound")
