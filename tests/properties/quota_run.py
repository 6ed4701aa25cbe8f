"""One generated quota history (``History``) played against one store (``Backend``): 2-3
replicas, each an ``AdmissionController`` with its own ``Admitter`` and its own client of the
store, whose every answer ``quota_model.py`` judges as it comes (``RecordingStore``). The
properties are in ``test_quota_properties.py``, which says what is checked and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol
from urllib.parse import urlsplit
from uuid import uuid4

from hypothesis import event, target

from admission.admitter import AdmissionConfig, Admitter
from admission.controller import (
    Admission,
    AdmissionController,
    ControllerConfig,
    StoreFailurePolicy,
)
from admission.plans import Plan, QuotaLimits
from admission.quota import Denial, QuotaSnapshot, QuotaStore, Reservation, StoreUnavailable
from admission.quota_memory import MemoryQuotaStore
from admission.quota_redis import RedisQuotaStore
from admission.tenants import Tenant
from core.errors import OverloadedError, RateLimitError, StoreUnavailableError
from core.prompt import TokenEstimate
from tests.properties.link import Link
from tests.properties.quota_model import Bracket, TenantModel
from tests.store_backends import delete_keys

QUEUE_TIMEOUT_S = 20.0
"""The admitters' queue deadline, on the fake clock."""
REDIS_TIME_SCALE = 0.002
"""Real seconds slept on Redis per second a step lets pass (an ``advance`` of 61 s: 0.12 s)."""
WALL_CLOCK_SLACK_S = 1e-4
"""Widening of a Redis call's bracket (the two clocks round differently)."""


# --- Histories --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrive:
    replica: int
    tenant: int
    percent: int
    """Its estimate, in percent of the tenant's TPM."""
    leaves_while_reserving: bool


@dataclass(frozen=True, slots=True)
class Finish:
    choice: int
    usage: Literal["none", "part", "all", "over", "never ran"]


@dataclass(frozen=True, slots=True)
class Leave:
    """A queued request's client goes away."""

    choice: int


@dataclass(frozen=True, slots=True)
class Crash:
    """A replica dies without settling anything; a fresh one takes its place."""

    replica: int


@dataclass(frozen=True, slots=True)
class Advance:
    seconds: float


Step = Arrive | Finish | Leave | Crash | Advance


@dataclass(frozen=True, slots=True)
class Outage:
    """A replica's link to the store is down over steps ``[start, start + steps)`` (Redis)."""

    replica: int
    start: int
    steps: int


@dataclass(frozen=True, slots=True)
class History:
    plans: tuple[Plan, ...]
    num_replicas: int
    capacity: int
    """Each replica's admitter: requests in flight."""
    max_queue: int
    hold_s: float
    policy: StoreFailurePolicy
    steps: tuple[Step, ...]
    outages: tuple[Outage, ...]


# --- The stores and the judge -----------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Backend(Protocol):
    """One quota store under test: a client of it per replica, a checker's client that no
    outage reaches, and the way its clock moves."""

    clock: Callable[[], float]
    """The store's clock, as the test can read it (a call's bracket)."""
    slack_s: float
    """How far a bracket is widened on each side."""
    time_scale: float
    """Store seconds per second a step lets pass."""
    checker: QuotaStore

    async def open_store(self) -> tuple[QuotaStore, Link | None]:
        """A new replica's client, and the link it reaches the store through (None: direct)."""
        ...

    async def pass_time(self, store_seconds: float) -> None:
        """Let the store's clock move on."""
        ...

    async def aclose(self) -> None:
        """Close every client and drop what the test stored."""
        ...


class MemoryBackend:
    """One in-memory store shared by the replicas (as by one gateway's requests), on a fake
    clock. It cannot be unreachable, and a crash abandons a replica's requests while the store
    lives on (as when a request's handler dies; a restarted gateway's store starts full, which
    docs/ARCHITECTURE.md states for the embedded default: counters in memory, one gateway)."""

    def __init__(self) -> None:
        self.fake = FakeClock()
        self.clock = self.fake
        self.slack_s = 0.0
        self.time_scale = 1.0
        self.checker = MemoryQuotaStore(self.fake)

    async def open_store(self) -> tuple[QuotaStore, Link | None]:
        return self.checker, None

    async def pass_time(self, store_seconds: float) -> None:
        self.fake.now += store_seconds

    async def aclose(self) -> None:
        pass


class RedisBackend:
    """A real redis-server; each replica's client reaches it through its own ``Link``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"test:{uuid4().hex}:"
        self.clock = time.time
        self.slack_s = WALL_CLOCK_SLACK_S
        self.time_scale = REDIS_TIME_SCALE
        self.checker = RedisQuotaStore(url, key_prefix=self.prefix, timeout_s=5.0)
        self.opened: list[tuple[QuotaStore, Link]] = []

    async def open_store(self) -> tuple[QuotaStore, Link | None]:
        address = urlsplit(self.url)
        assert address.hostname is not None and address.port is not None
        link = Link(address.hostname, address.port)
        await link.start()
        # A cut link fails a call at once (its connection reset or closed), so the timeout
        # only has to outlast a busy machine (as tests/admission/test_quota_store.py says).
        store = RedisQuotaStore(
            f"redis://127.0.0.1:{link.port}/0", key_prefix=self.prefix, timeout_s=5.0
        )
        self.opened.append((store, link))
        return store, link

    async def pass_time(self, store_seconds: float) -> None:
        await asyncio.sleep(store_seconds)

    async def aclose(self) -> None:
        for store, link in self.opened:
            await store.aclose()
            await link.aclose()
        await self.checker.aclose()
        await delete_keys(self.url, self.prefix)


class RecordingStore:
    """A replica's client of the store: every call goes to the real store, and its answer,
    with the bracket of the store's clock during the call, to the tenant's model. Calls of a
    crashed replica reach nothing."""

    def __init__(
        self, inner: QuotaStore, link: Link | None, backend: Backend, models: dict[str, TenantModel]
    ) -> None:
        self._inner = inner
        self._link = link
        self._backend = backend
        self._models = models
        self.answers_at_once = inner.answers_at_once  # it adds no wait of its own
        self.crashed = False
        self.last_reserve: Literal["granted", "refused", "failed"] | None = None
        self.last_reservation: Reservation | None = None
        self.lost: set[str] = set()
        """Reservations whose reconcile an outage lost (their holds wait for their expiry)."""
        self.failures: list[AssertionError] = []

    async def reserve(
        self, tenant_id: str, limits: QuotaLimits, tokens: int, hold_s: float
    ) -> Reservation | Denial:
        if self.crashed:
            raise StoreUnavailable("this replica crashed")
        started = self._backend.clock()
        try:
            answer = await self._inner.reserve(tenant_id, limits, tokens, hold_s)
        except StoreUnavailable as exc:
            with self._verdict():
                self._failed("reserve", exc)
            self.last_reserve = "failed"
            event("reserve failed: store unreachable")
            raise
        with self._verdict():
            self._models[tenant_id].reserved(tokens, hold_s, self._bracket(started), answer)
        granted = isinstance(answer, Reservation)
        self.last_reserve = "granted" if granted else "refused"
        self.last_reservation = answer if granted else None
        event("reserve granted" if granted else f"reserve refused: {answer.limit}")
        return answer

    async def reconcile(
        self, reservation: Reservation, limits: QuotaLimits, used_tokens: int, *, ran: bool = True
    ) -> None:
        if self.crashed:
            raise StoreUnavailable("this replica crashed")
        started = self._backend.clock()
        try:
            await self._inner.reconcile(reservation, limits, used_tokens, ran=ran)
        except StoreUnavailable as exc:
            with self._verdict():
                self._failed("reconcile", exc)  # not carried out: its hold lives till its expiry
            self.lost.add(reservation.reservation_id)
            event("reconcile lost to an outage")
            raise
        with self._verdict():
            model = self._models[reservation.tenant_id]
            model.reconciled(reservation, used_tokens, ran, self._bracket(started))

    async def snapshot(self, tenant_id: str, limits: QuotaLimits) -> QuotaSnapshot:
        return await self._inner.snapshot(tenant_id, limits)

    async def forget(self, tenant_id: str) -> None:
        await self._inner.forget(tenant_id)

    async def aclose(self) -> None:
        """The backend closes the real clients."""

    @contextlib.contextmanager
    def _verdict(self) -> Iterator[None]:
        """Keeps a failed check: raised inside ``admit``, a request that left meanwhile would
        swallow it (``QuotaRun.settle`` raises it)."""
        try:
            yield
        except AssertionError as failure:
            self.failures.append(failure)
            raise

    def _bracket(self, started: float) -> Bracket:
        assert self._link is None or self._link.up, "the store answered through a cut link"
        slack = self._backend.slack_s
        return Bracket(started - slack, self._backend.clock() + slack)

    def _failed(self, operation: str, error: StoreUnavailable) -> None:
        # A cut link carries nothing: the call did not happen. While it is up, the client must
        # reach the store (it reconnects by itself after an outage).
        assert self._link is not None and not self._link.up, (
            f"{operation} failed while the store was reachable: {error}"
        )


# --- Replicas and requests --------------------------------------------------------------------


@dataclass(eq=False)
class Request:
    replica: Replica
    tenant: Tenant
    tokens: int
    task: asyncio.Task[Admission] | None = None
    headers: dict[str, str] | None = None
    """The rate-limit headers ``admit`` announced once reserved ({}: no reservation)."""
    admission: Admission | None = None
    reservation: Reservation | None = None
    """What the store granted it, if anything."""


@dataclass(eq=False)
class Replica:
    store: RecordingStore
    link: Link | None
    admitter: Admitter
    controller: AdmissionController
    waiting: list[Request] = field(default_factory=list)
    """Requests whose ``admit`` has not returned (reserving, or queued)."""
    running: list[Request] = field(default_factory=list)


class QuotaRun:
    """One generated history against one backend."""

    def __init__(self, history: History, backend: Backend) -> None:
        self.history = history
        self.backend = backend
        self.admitter_clock = FakeClock()
        self.tenants = [
            Tenant(f"t{i}", f"tenant-{i}", plan, 0.0, 0.0) for i, plan in enumerate(history.plans)
        ]
        self.models = {t.tenant_id: TenantModel(QuotaLimits.of(t.plan)) for t in self.tenants}
        self.replicas: list[Replica] = []
        self.abandoned: list[Request] = []
        """Requests of crashed replicas: never settled."""
        self.requests: list[Request] = []
        """Every request so far."""
        self.lost: set[str] = set()
        """Reservations whose reconcile an outage lost, of replicas replaced since."""

    async def start(self) -> None:
        self.replicas = [await self.new_replica() for _ in range(self.history.num_replicas)]

    async def new_replica(self) -> Replica:
        inner, link = await self.backend.open_store()
        store = RecordingStore(inner, link, self.backend, self.models)
        admitter = Admitter(
            AdmissionConfig(
                max_queue=self.history.max_queue,
                max_in_flight=self.history.capacity,
                default_queue_timeout_s=QUEUE_TIMEOUT_S,
            ),
            clock=self.admitter_clock,
        )
        config = ControllerConfig(store_failure=self.history.policy, hold_s=self.history.hold_s)
        return Replica(store, link, admitter, AdmissionController(store, admitter, config))

    def replica(self, index: int) -> Replica:
        return self.replicas[index % len(self.replicas)]

    def links_at(self, index: int) -> None:
        """Cut or restore each replica's link as the outages say for step ``index``."""
        for slot, replica in enumerate(self.replicas):
            down = any(
                outage.replica % len(self.replicas) == slot
                and outage.start <= index < outage.start + outage.steps
                for outage in self.history.outages
            )
            if replica.link is not None and down == replica.link.up:
                replica.link.cut() if down else replica.link.restore()

    # -- steps -------------------------------------------------------------------------------

    async def step(self, step: Step) -> None:
        if isinstance(step, Arrive):
            await self.arrive(step)
        elif isinstance(step, Finish):
            await self.finish(step)
        elif isinstance(step, Leave):
            waiting = [r for replica in self.replicas for r in replica.waiting]
            if waiting:
                request = waiting[step.choice % len(waiting)]
                assert request.task is not None
                request.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await request.task
        elif isinstance(step, Crash):
            index = step.replica % len(self.replicas)
            crashed = self.replicas[index]
            crashed.store.crashed = True
            self.lost |= crashed.store.lost
            event("replica crashed")
            if crashed.link is not None:
                crashed.link.cut()  # its connections die with it
            self.abandoned += crashed.waiting + crashed.running
            self.replicas[index] = await self.new_replica()
        elif isinstance(step, Advance):
            self.admitter_clock.now += step.seconds
            await self.backend.pass_time(step.seconds * self.backend.time_scale)
            for replica in self.replicas:
                replica.admitter.poll()  # queue deadlines
        await self.settle()
        await self.check_snapshots()

    async def arrive(self, step: Arrive) -> None:
        replica = self.replica(step.replica)
        tenant = self.tenants[step.tenant]
        assert tenant.plan.tpm is not None
        tokens = max(1, math.ceil(tenant.plan.tpm * step.percent / 100))
        request = Request(replica, tenant, tokens)
        estimate = TokenEstimate(tokens // 2, tokens - tokens // 2, 1)

        def reserved(headers: dict[str, str]) -> None:
            request.headers = headers

        replica.store.last_reserve = replica.store.last_reservation = None
        request.task = asyncio.create_task(
            replica.controller.admit(tenant, estimate, None, on_reserved=reserved)
        )
        replica.waiting.append(request)
        # A store that answers at once (in memory) leaves the client no moment to hang up while
        # it reserves: admit never waits for it.
        leaves = step.leaves_while_reserving and not replica.store.answers_at_once
        if leaves:
            await asyncio.sleep(0)  # admit is now waiting for the store's answer
            request.task.cancel()
        await self.settle()
        request.reservation = replica.store.last_reservation
        self.requests.append(request)
        self.check_arrival(request, replica.store.last_reserve, leaves)

    def check_arrival(
        self, request: Request, reserve: Literal["granted", "refused", "failed"] | None, left: bool
    ) -> None:
        """What the controller made of the store's answer."""
        task = request.task
        assert task is not None
        if task.done() and not task.cancelled() and isinstance(task.exception(), AssertionError):
            raise task.exception()  # type: ignore[misc]  # the model's verdict, from inside admit
        assert reserve is not None, "admit never asked the store"
        if left:
            assert task.cancelled()  # and a grant was given back: the model saw its reconcile
            return
        error = task.exception() if task.done() else None
        if reserve == "failed":
            event(f"store unreachable, policy {self.history.policy}")
        if reserve == "refused":
            assert isinstance(error, RateLimitError), error
        elif reserve == "failed" and self.history.policy is StoreFailurePolicy.CLOSED:
            assert isinstance(error, StoreUnavailableError), error
            assert error.status_code == 503 and error.retry_after_s is not None
        else:
            # Granted, or failed open: admitted, queued, or shed from a full queue.
            assert error is None or isinstance(error, OverloadedError), error
            granted = reserve == "granted"
            assert request.headers is not None and bool(request.headers) == granted, (
                f"reserve {reserve} but headers {request.headers}"
            )

    async def finish(self, step: Finish) -> None:
        running = [r for replica in self.replicas for r in replica.running]
        if not running:
            return
        request = running[step.choice % len(running)]
        request.replica.running.remove(request)
        assert request.admission is not None
        used = {
            "none": 0,
            "part": request.tokens // 2,
            "all": request.tokens,
            "over": request.tokens + max(1, request.tokens // 3),
            "never ran": 0,
        }[step.usage]
        await request.admission.settle(used, ran=step.usage != "never ran")

    async def settle(self) -> None:
        """Run the requests until each is admitted, refused, or queued."""
        deadline = time.monotonic() + 10.0
        while True:
            await asyncio.sleep(0)
            for replica in self.replicas:
                for request in list(replica.waiting):
                    assert request.task is not None
                    if not request.task.done():
                        continue
                    replica.waiting.remove(request)
                    if not request.task.cancelled() and isinstance(
                        error := request.task.exception(), AssertionError
                    ):
                        raise error  # the model's verdict on a call made inside admit
                    if not request.task.cancelled() and request.task.exception() is None:
                        request.admission = request.task.result()
                        replica.running.append(request)
            for replica in self.replicas:
                if replica.store.failures:
                    raise replica.store.failures[0]
            if all(len(r.waiting) == r.admitter.num_queued for r in self.replicas):
                return
            assert time.monotonic() < deadline, "requests neither admitted nor queued"
            pending = [r.task for replica in self.replicas for r in replica.waiting if r.task]
            await asyncio.wait(pending, timeout=0.005, return_when=asyncio.FIRST_COMPLETED)

    async def check_snapshots(self) -> list[QuotaSnapshot]:
        snapshots = []
        for tenant in self.tenants:
            started = self.backend.clock()
            snapshot = await self.backend.checker.snapshot(
                tenant.tenant_id, QuotaLimits.of(tenant.plan)
            )
            slack = self.backend.slack_s
            when = Bracket(started - slack, self.backend.clock() + slack)
            self.models[tenant.tenant_id].snapshot_seen(snapshot, when)
            snapshots.append(snapshot)
        return snapshots

    # -- the end -----------------------------------------------------------------------------

    async def end(self) -> None:
        """Links back up, every live request settled or gone; once the longest hold has
        expired, no hold is left: not of crashed replicas, not of reconciles an outage lost."""
        for replica in self.replicas:
            if replica.link is not None:
                replica.link.restore()
        # A request settled may admit a queued one meanwhile: until none is left.
        while live := [r for replica in self.replicas for r in replica.running + replica.waiting]:
            for request in live:
                if request in request.replica.running:
                    request.replica.running.remove(request)
                    assert request.admission is not None
                    await request.admission.settle(request.tokens)
                elif request.task is not None and not request.task.done():
                    request.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await request.task
            await self.settle()
        # Everything taken was given back, exactly once (the model refuses a second time):
        # but for what crashed replicas held and what an outage lost.
        lost = self.lost.union(*(replica.store.lost for replica in self.replicas))
        abandoned = {id(request) for request in self.abandoned}
        for request in self.requests:
            if request.reservation is None or id(request) in abandoned:
                continue
            rid = request.reservation.reservation_id
            settled = self.models[request.tenant.tenant_id].holds[rid].settled
            assert settled or rid in lost, f"reservation {rid} was never given back"
        await self.backend.pass_time(self.history.hold_s + 2 * self.backend.slack_s)
        for snapshot in await self.check_snapshots():
            assert snapshot.concurrent == 0, "a hold outlived its expiry"
        target(
            max(model.closest_to_bound for model in self.models.values()),
            label="closest to the bound",
        )

    async def aclose(self) -> None:
        tasks = [r.task for r in self.abandoned if r.task is not None]
        for replica in self.replicas:
            tasks += [r.task for r in replica.waiting if r.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica in self.replicas:
            await replica.admitter.aclose()


async def run_history(history: History, backend: Backend) -> None:
    run = QuotaRun(history, backend)
    try:
        await run.start()
        for index, step in enumerate(history.steps):
            run.links_at(index)
            await run.step(step)
        await run.end()
    finally:
        await run.aclose()
        await backend.aclose()
