"""Property (issue 25): whatever happens between a request's end and the ledger, every finished
request is in the ledger exactly once, and its totals equal the tokens metered.

Hypothesis generates histories and plays each against the real ``LedgerWriter`` (spool segments
on disk, batched inserts on its database thread, replay at start) over a fresh ledger database:
a SQLite file, and a database on the session's real PostgreSQL (fewer examples). The steps:

    Submit     finished requests handed to ``submit()`` (some with a request-log entry, some
               idempotent ones run again: the same record id, billed once, for its first run);
               with ``during_flush`` they arrive while a flush is in flight
    Flush      ``flush()``: with the database up and no acknowledgement to lose it must say True,
               and True means everything submitted before it is in the ledger. With
               ``lose_ack`` the next insert (this flush's, or a later one's) commits and then
               the writer sees the connection fail: a COMMIT whose acknowledgement was lost
               (``FlakyStore`` of tests/billing/test_writer.py)
    Outage     the database goes down or comes back (also across restarts)
    Crash      the gateway process dies, now or while a flush is at its n-th insert, and a new
               writer starts over the same spool directory and replays what it finds; the dead
               one is never closed (``kill``)

The history may start with the database down, so the first writer starts on a ledger it cannot
migrate yet. At the end the database is up and one flush must write everything: then each
finished request is in the ledger once with the values metered (an idempotent one's first run),
each request-log entry once, the token and cost totals equal the metered ones, and the spool is
empty.

More examples: ``TANDEM_HYPOTHESIS_PROFILE=thorough`` (tests/properties/profiles.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import event, given, note, settings
from hypothesis import strategies as st

from billing.records import UsageRecord, idempotent_record_id
from billing.sql_store import PostgresLedgerStore, SqliteLedgerStore, SqlLedgerStore
from billing.store import Cursor, RequestLogEntry, UsageQuery
from billing.writer import LedgerWriter, WriterConfig
from tests.billing.records_factory import HOUR_US, T0, make_record
from tests.billing.test_writer import FlakyStore
from tests.properties.drawing import NO_EXPLAIN, weighted
from tests.properties.profiles import examples

if TYPE_CHECKING:
    from tests.postgres_server import PostgresServer

ALL_TIME = UsageQuery(0, 2**62)
TENANTS = ("acme", "globex", "initech")
NEVER_S = 3600.0
"""The flusher's own timer and retry wait: the history decides when flushes happen (a full
batch still wakes the flusher, as it does in the gateway)."""


# -- the steps of a history --------------------------------------------------------------------


@dataclass(frozen=True)
class Metered:
    """One finished request's usage, as the gateway metered it."""

    tenant: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    idempotent: bool
    """Billed under ``idempotent_record_id`` (a request sent with an ``Idempotency-Key``)."""
    logged: bool
    """Its tenant keeps a request log: a ``RequestLogEntry`` travels with it."""
    rerun: int | None
    """None: a request of its own. k: the k-th idempotent request metered so far (modulo; -1:
    the latest) ran again, as when its retry reaches a gateway that lost the stored answer (a
    restart of the in-memory idempotency store): the same record id, its own request id and
    usage. Its first run is the one billed."""


@dataclass(frozen=True)
class Submit:
    requests: tuple[Metered, ...]
    during_flush: bool


@dataclass(frozen=True)
class Flush:
    lose_ack: bool


@dataclass(frozen=True)
class Outage:
    down: bool


@dataclass(frozen=True)
class Crash:
    at_insert: int | None
    """None: between two steps; n: a flush runs and the process dies as its n-th insert starts
    (after the n-1 before it committed)."""


Step = Submit | Flush | Outage | Crash


@dataclass(frozen=True)
class History:
    starts_down: bool
    """The database is down when the first writer starts (its schema is not there yet)."""
    max_batch: int
    steps: tuple[Step, ...]


@st.composite
def metered(draw: st.DrawFn) -> Metered:
    prompt = draw(st.integers(0, 8000))
    return Metered(
        tenant=draw(st.integers(0, len(TENANTS) - 1)),
        prompt_tokens=prompt,
        completion_tokens=draw(st.integers(0, 4000)),
        cached_tokens=draw(st.integers(0, prompt)),
        idempotent=draw(st.booleans()),
        logged=draw(st.booleans()),
        rerun=draw(st.sampled_from((None, None, None, None, 0, -1))),
    )


steps = weighted(  # requests and flushes twice as often as the faults between them
    (2, st.builds(Submit, st.lists(metered(), min_size=1, max_size=5).map(tuple), st.booleans())),
    (2, st.builds(Flush, st.booleans())),
    (1, st.builds(Outage, st.booleans())),
    (1, st.builds(Crash, st.none() | st.integers(1, 3))),
)
histories = st.builds(
    History,
    starts_down=st.booleans(),
    # 2: a segment spans several batches, so a crash or a lost ack can fall between them.
    max_batch=st.sampled_from((2, 1000)),
    steps=st.lists(steps, min_size=2, max_size=14).map(tuple),
)


# -- playing one history -----------------------------------------------------------------------


class GatewayDied(BaseException):
    """Raised on the ledger thread where the process dies; nothing in the writer catches it."""


class Player:
    """Plays a history: the live writer, the writers it killed, and what was metered."""

    def __init__(self, open_store: Callable[[], SqlLedgerStore], spool_dir: Path, max_batch: int):
        self._open_store = open_store
        self._config = WriterConfig(
            spool_dir=spool_dir,
            flush_interval_s=NEVER_S,
            max_batch=max_batch,
            retry_initial_s=NEVER_S,
            retry_max_s=NEVER_S,
        )
        self.auditor = open_store()
        """Looks at the ledger on a connection of its own, never through a writer."""
        self.down = False
        self.metered: dict[str, UsageRecord] = {}
        self.logged: dict[str, RequestLogEntry] = {}
        self.store: FlakyStore
        self.writer: LedgerWriter
        self._stores: list[SqlLedgerStore] = [self.auditor]
        self._writers: list[LedgerWriter] = []
        self._inserts = 0
        self._runs = 0

    async def start(self) -> None:
        """A gateway process starts: its own connections, the spool directory it inherits."""
        inner = self._open_store()
        self._stores.append(inner)
        self.store = FlakyStore(inner)
        self.store.down = self.down  # an outage is the database's, it outlives the process
        self.writer = LedgerWriter(self.store, self._config)
        self._writers.append(self.writer)
        await self.writer.start()

    async def play(self, step: Step) -> None:
        match step:
            case Submit(requests, during_flush=False):
                self.submit(requests)
            case Submit(requests, during_flush=True):
                before = set(self.metered)
                flushing = asyncio.create_task(self.writer.flush())
                await asyncio.sleep(0)  # it sealed the segment and waits on the database
                self.submit(requests)
                if await flushing:
                    self.assert_in_ledger(before)
            case Flush(lose_ack):
                self.store.lose_acks += lose_ack
                await self.flush()
            case Outage(down):
                self.down = self.store.down = down
            case Crash(at_insert=None):
                await self.restart()
            case Crash(at_insert=n):
                assert n is not None
                self.die_at_insert(n)
                with contextlib.suppress(GatewayDied):
                    await self.writer.flush()
                await self.restart()

    def submit(self, requests: tuple[Metered, ...]) -> None:
        for usage in requests:
            number, self._runs = self._runs, self._runs + 1
            tenant = TENANTS[usage.tenant]
            record_id = (
                idempotent_record_id(tenant, "chat", f"key-{number}")
                if usage.idempotent
                else f"req-{number:05d}"
            )
            keyed = [known for known in self.metered if known.startswith("idem-")]
            if usage.rerun is not None and keyed:
                record_id = keyed[usage.rerun % len(keyed)]
                tenant = self.metered[record_id].tenant_id
                event("an idempotent request ran again")
            record = make_record(
                record_id=record_id,
                request_id=f"chatcmpl-{number:05d}",
                tenant_id=tenant,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                finished_at_us=T0 + HOUR_US + number,
                cost_micros=3 * usage.prompt_tokens + 7 * usage.completion_tokens,
            )
            entry = None
            if usage.logged:
                entry = RequestLogEntry(
                    record_id, record.request_id, tenant, record.finished_at_us,
                    record.finished_at_us + HOUR_US, f"prompt {number}", f"output {number}",
                )  # fmt: skip
                self.logged.setdefault(record_id, entry)
            self.metered.setdefault(record_id, record)  # its first run is billed
            self.writer.submit(record, entry)

    async def flush(self) -> None:
        """A flush with the database up must write everything submitted before it."""
        database_up = not self.store.down and self.store.lose_acks == 0
        written = await self.writer.flush()
        if database_up:
            assert written, "the database is up, yet the writer could not write the spool"
        if written:
            self.assert_in_ledger(set(self.metered))
            assert self.writer.num_pending == 0
            assert not list(self._config.spool_dir.glob("*.jsonl")), "written, yet still spooled"

    def die_at_insert(self, n: int) -> None:
        self._inserts = 0

        def count() -> None:  # on the ledger thread, before the insert
            self._inserts += 1
            if self._inserts == n:
                raise GatewayDied

        self.store.before_insert = count

    async def restart(self) -> None:
        await kill(self.writer)
        self._tally(self.writer)
        await self.start()
        if self.writer.num_pending:
            event("a restart found records spooled")

    def _tally(self, writer: LedgerWriter) -> None:
        """What the writers saw (``--hypothesis-show-statistics`` shows how often)."""
        if writer.stats.num_duplicates:
            event("the ledger ignored record ids it had (a replay, a re-run)")

    async def finish(self) -> None:
        """The database is back for good: one flush writes everything, exactly once."""
        self.down = self.store.down = False
        self.store.lose_acks = 0
        await self.flush()
        self.assert_exactly_once()
        await self.writer.aclose()
        self._tally(self.writer)

    def assert_in_ledger(self, record_ids: set[str]) -> None:
        in_ledger = ledger(self.auditor)
        missing = record_ids - set(in_ledger)
        assert not missing, f"{len(missing)} record(s) flushed but not in the ledger"
        for record_id, record in in_ledger.items():
            assert record == self.metered.get(record_id), f"{record_id} is not what was metered"

    def assert_exactly_once(self) -> None:
        in_ledger = ledger(self.auditor)
        count, cost = self.auditor.count_usage(ALL_TIME)
        assert count == len(in_ledger) == len(self.metered)
        assert in_ledger == self.metered
        assert len({record.request_id for record in in_ledger.values()}) == count
        assert sum(r.total_tokens for r in in_ledger.values()) == sum(
            r.total_tokens for r in self.metered.values()
        )
        assert cost == sum(record.cost_micros for record in self.metered.values())
        logs = [
            entry
            for tenant in TENANTS
            for entry in self.auditor.request_log(tenant, 0, 2**62, 10_000)
        ]
        assert sorted(logs, key=lambda e: e.record_id) == sorted(
            self.logged.values(), key=lambda e: e.record_id
        )
        assert not list(self._config.spool_dir.glob("*.jsonl"))

    async def close(self) -> None:
        """However the history ended (a failed check too): no thread, task or file left."""
        for writer in self._writers:
            await kill(writer)
        for store in self._stores:
            store.close()


async def kill(writer: LedgerWriter) -> None:
    """What the OS does to a gateway process's ledger writer when the process dies: its tasks
    stop where they are, the ledger thread's current call (one transaction, committed whole or
    not at all) is the last one, its spool file closes. No ``aclose()``: no last flush. Killing
    a writer that was killed or closed already does nothing."""
    task = writer._task
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, GatewayDied):
            await task
    await asyncio.to_thread(writer._executor.shutdown, wait=True, cancel_futures=True)
    current = writer._current
    if current is not None and current.fd is not None:
        os.close(current.fd)
        current.fd = None


def ledger(store: SqlLedgerStore) -> dict[str, UsageRecord]:
    """Every record in the ledger by id (a repeated id would fail the count check)."""
    records: dict[str, UsageRecord] = {}
    after: Cursor | None = None
    while page := store.usage_page(ALL_TIME, after, 500):
        records.update((record.record_id, record) for record in page)
        after = Cursor(page[-1].finished_at_us, page[-1].record_id)
    return records


async def play(history: History, open_store: Callable[[], SqlLedgerStore], spool: Path) -> None:
    note(repr(history))  # see NO_EXPLAIN
    player = Player(open_store, spool, history.max_batch)
    try:
        player.down = history.starts_down
        await player.start()
        for step in history.steps:
            await player.play(step)
        await player.finish()
    finally:
        await player.close()


# -- the properties, per backend ---------------------------------------------------------------


@settings(max_examples=examples(40), phases=NO_EXPLAIN)
@given(history=histories)
def test_sqlite_ledger_holds_every_request_once(
    history: History, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = tmp_path_factory.mktemp("ledger")
    database = folder / "ledger.db"  # fresh: the first writer migrates it
    asyncio.run(play(history, lambda: SqliteLedgerStore(database), folder / "spool"))


@settings(max_examples=examples(10), phases=NO_EXPLAIN)
@given(history=histories)
def test_postgres_ledger_holds_every_request_once(
    history: History, tmp_path_factory: pytest.TempPathFactory, postgres_server: PostgresServer
) -> None:
    url = postgres_server.create_database(f"ledger_prop_{uuid.uuid4().hex[:16]}")
    spool = tmp_path_factory.mktemp("ledger") / "spool"
    asyncio.run(play(history, lambda: PostgresLedgerStore(url), spool))
