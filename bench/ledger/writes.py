"""Ledger write throughput on one backend: the store's batch inserts alone, then the real
``LedgerWriter`` fed from an event loop.

On a fresh ledger, in this order:

1. ``insert_usage`` alone, batches of 1, 100 and 1000 records one after the other on one thread
   (one transaction per batch, as the writer's): rows per second and the time of one batch. A
   size stops after ``num_records`` records or ``seconds``, whichever comes first.
2. ``submit()`` in a tight loop over ``num_records`` prebuilt records while the database thread
   is idle: what one call costs the event loop, nothing else competing.
3. Sustained: for ``seconds`` per producer, records are built and submitted on the event loop
   while the writer flushes every ``flush_interval_s`` (0.2 s, the gateway's) or at a full
   batch; then ``flush()``. Committed per second = records / (first submit -> ``flush()``
   returned), and the ledger's row count must have grown by exactly that many. Two kinds of
   producer:

   - *saturating*: submit, yield to the loop (``sleep(0)``), submit... The loop never idles, as
     in a gateway at 100% CPU. The database thread then gets the GIL back only once per switch
     interval (5 ms) each time the driver releases it (per row in ``sqlite3``'s
     ``executemany``): little is written while the producer runs, the rest after it stops.
   - *paced* at each of ``rates``: the records due are submitted every millisecond and the
     loop idles in between, as in a gateway below saturation.

   Every ``submit()`` is timed: its cost while the database thread competes for the GIL.

PostgreSQL without ``--postgres-url`` runs on a throwaway cluster from ``tests.postgres_server``
(the test suite's fixture, imported from the benchmark on purpose rather than copied): that
cluster runs with ``fsync=off`` and ``synchronous_commit=off``, so its figures are an upper
bound; the settings each run used are read back from the server and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.summary import Stats
from billing.records import RequestStatus, UsageRecord
from billing.sql_store import PostgresLedgerStore, SqliteLedgerStore, SqlLedgerStore
from billing.store import UsageQuery
from billing.writer import LedgerWriter, WriterConfig

BACKENDS = ("sqlite", "postgres")
BATCH_SIZES = (1, 100, 1000)
_EVERYTHING = UsageQuery(start_us=0, end_us=2**62)


class BenchError(RuntimeError):
    """The benchmark cannot run as asked; the message says what to do."""


@dataclass(frozen=True, slots=True)
class WritesSpec:
    """How much each backend is asked to write."""

    num_records: int = 20_000
    """Records per batch size of the raw inserts, and of the tight ``submit()`` loop."""
    seconds: float = 5.0
    """Length of each sustained producer's run; also the cap of each raw batch size."""
    rates: tuple[int, ...] = (1_000, 5_000, 10_000, 20_000)
    """Records per second of the paced producers."""
    batch_sizes: tuple[int, ...] = BATCH_SIZES
    flush_interval_s: float = 0.2
    """The writer's flush interval (the gateway's ``BillingConfig.flush_interval_s``)."""


@dataclass(frozen=True, slots=True)
class BatchResult:
    """``insert_usage`` alone at one batch size."""

    batch_size: int
    num_records: int
    wall_s: float
    batch_ms: Stats | None

    @property
    def rows_per_s(self) -> float:
        return self.num_records / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "num_records": self.num_records,
            "wall_s": self.wall_s,
            "rows_per_s": self.rows_per_s,
            "batch_ms": self.batch_ms.to_dict() if self.batch_ms else None,
        }


@dataclass(frozen=True, slots=True)
class SustainedResult:
    """The writer under one producer for ``produce_s``, then one ``flush()``."""

    rate: int | None
    """Records per second asked of a paced producer; None: the saturating producer."""
    num_submitted: int
    num_committed: int
    """Rows the ledger gained (must equal ``num_submitted``)."""
    produce_s: float
    num_written_while_producing: int
    """Records the writer had committed when the producer stopped."""
    backlog: int
    """Records not yet committed when the producer stopped."""
    drain_s: float
    """Producer stopped -> ``flush()`` returned."""
    flushed: bool
    """``flush()`` said every record is in the database."""
    num_write_failures: int
    submit_us: Stats | None
    """One ``submit()`` call while the database thread was writing."""

    @property
    def end_to_end_s(self) -> float:
        return self.produce_s + self.drain_s

    @property
    def committed_per_s(self) -> float:
        return self.num_committed / self.end_to_end_s if self.end_to_end_s > 0 else 0.0

    @property
    def offered_per_s(self) -> float:
        return self.num_submitted / self.produce_s if self.produce_s > 0 else 0.0

    @property
    def written_per_s_while_producing(self) -> float:
        return self.num_written_while_producing / self.produce_s if self.produce_s > 0 else 0.0

    @property
    def producer(self) -> str:
        return "saturating" if self.rate is None else f"paced {self.rate:,}/s"

    def to_dict(self) -> dict[str, Any]:
        return {
            "producer": self.producer,
            "rate": self.rate,
            "num_submitted": self.num_submitted,
            "num_committed": self.num_committed,
            "produce_s": self.produce_s,
            "drain_s": self.drain_s,
            "end_to_end_s": self.end_to_end_s,
            "committed_per_s": self.committed_per_s,
            "offered_per_s": self.offered_per_s,
            "num_written_while_producing": self.num_written_while_producing,
            "written_per_s_while_producing": self.written_per_s_while_producing,
            "backlog": self.backlog,
            "flushed": self.flushed,
            "num_write_failures": self.num_write_failures,
            "submit_us": self.submit_us.to_dict() if self.submit_us else None,
        }


@dataclass(slots=True)
class BackendResult:
    """Every figure of one backend."""

    backend: str
    durability: str
    """The settings that decide what a commit waits for (read back from the database)."""
    batches: list[BatchResult] = field(default_factory=list)
    submit_idle_us: Stats | None = None
    """One ``submit()`` call in a tight loop, the database thread idle."""
    sustained: list[SustainedResult] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "durability": self.durability,
            "batches": [batch.to_dict() for batch in self.batches],
            "submit_idle_us": self.submit_idle_us.to_dict() if self.submit_idle_us else None,
            "sustained": [run.to_dict() for run in self.sustained],
        }


class RecordFactory:
    """Distinct records shaped like the gateway's (a completed, priced chat request)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:12]
        self._num_made = 0

    def make(self) -> UsageRecord:
        self._num_made += 1
        number = self._num_made
        finished_at_us = time.time_ns() // 1000
        return UsageRecord(
            record_id=f"bench-{self._prefix}-{number:010d}",
            request_id=f"chatcmpl-{self._prefix}{number:010d}",
            tenant_id=f"tenant-{number % 50:02d}",
            key_id=f"key-{number % 50:02d}",
            model="llama-3.1-8b-instruct",
            model_version="llama-3.1-8b-instruct@5f0b02c7",
            deployment="stable",
            endpoint="chat",
            path="disaggregated",
            status=RequestStatus.COMPLETED,
            finish_reason="stop",
            error_code=None,
            moderation_action=None,
            prompt_tokens=812,
            completion_tokens=164,
            cached_tokens=256,
            ttft_us=143_211,
            e2e_us=3_402_118,
            started_at_us=finished_at_us - 3_402_118,
            finished_at_us=finished_at_us,
            cost_micros=1_318,
            price_effective_from_us=1_767_225_600_000_000,
            currency="USD",
        )

    def make_many(self, count: int) -> list[UsageRecord]:
        return [self.make() for _ in range(count)]


def open_store(backend: str, sqlite_dir: Path, postgres_url: str | None) -> SqlLedgerStore:
    if backend == "sqlite":
        return SqliteLedgerStore(sqlite_dir / "ledger.db")
    if postgres_url is None:
        raise BenchError("the postgres backend needs a database URL")
    return PostgresLedgerStore(postgres_url)


def durability(backend: str, postgres_url: str | None) -> str:
    """What a commit waits for on this backend."""
    if backend == "sqlite":
        return "WAL, synchronous=FULL (set by SqliteLedgerStore): fsync per commit"
    import psycopg

    if postgres_url is None:
        raise BenchError("the postgres backend needs a database URL")
    names = ("fsync", "synchronous_commit", "full_page_writes")
    with psycopg.connect(postgres_url, autocommit=True) as connection:
        values = [connection.execute(f"SHOW {name}").fetchone() for name in names]
    return ", ".join(f"{n}={v[0] if v else '?'}" for n, v in zip(names, values, strict=True))


@contextlib.contextmanager
def postgres_database(url: str | None) -> Iterator[str]:
    """``url`` as given, else a fresh database on a throwaway cluster (see the docstring)."""
    if url is not None:
        yield url
        return
    from tests.postgres_server import find_bindir, running_postgres

    if find_bindir() is None:
        raise BenchError(
            "PostgreSQL is not installed (no initdb): run scripts/install --dev, or pass "
            "--postgres-url postgresql://user@host/db (a scratch database)"
        )
    with running_postgres() as server:
        yield server.create_database(f"ledger_bench_{uuid.uuid4().hex[:12]}")


def raw_inserts(
    store: SqlLedgerStore, factory: RecordFactory, spec: WritesSpec
) -> list[BatchResult]:
    """Step 1 (see the module docstring), on the calling thread."""
    store.migrate()
    results = []
    for size in spec.batch_sizes:
        records = factory.make_many(spec.num_records)
        batch_ns: list[int] = []
        num_inserted = 0
        started = time.perf_counter()
        deadline = started + spec.seconds
        for start in range(0, len(records), size):
            t0 = time.perf_counter_ns()
            num_inserted += store.insert_usage(records[start : start + size]).num_inserted
            batch_ns.append(time.perf_counter_ns() - t0)
            if time.perf_counter() >= deadline:
                break
        wall_s = time.perf_counter() - started
        results.append(BatchResult(size, num_inserted, wall_s, Stats.of(n / 1e6 for n in batch_ns)))
    return results


async def writer_runs(
    store: SqlLedgerStore, factory: RecordFactory, spec: WritesSpec, spool_dir: Path
) -> tuple[Stats | None, list[SustainedResult]]:
    """Steps 2 and 3 (see the module docstring), on the running event loop."""
    config = WriterConfig(spool_dir=spool_dir, flush_interval_s=spec.flush_interval_s)
    writer = LedgerWriter(store, config)
    await writer.start()
    try:
        idle = await _tight_submits(writer, factory, spec.num_records)
        runs = []
        for rate in (None, *spec.rates):
            runs.append(await _sustained(writer, store, factory, spec.seconds, rate))
    finally:
        await _close(writer, spec.flush_interval_s)
    return idle, runs


async def _close(writer: LedgerWriter, flush_interval_s: float) -> None:
    # On Python 3.11, ``asyncio.wait_for`` swallows a cancellation that arrives as its inner
    # awaitable completes: ``aclose()`` cancelling the flusher just as a submit woke it would
    # wait for ever. Letting the flusher settle first (nothing is submitted any more) keeps it
    # out of that window; the timeout turns a hang into an error.
    await asyncio.sleep(2 * flush_interval_s)
    try:
        async with asyncio.timeout(30):
            await writer.aclose()
    except TimeoutError:
        raise BenchError("LedgerWriter.aclose() did not return within 30 s") from None


async def _tight_submits(writer: LedgerWriter, factory: RecordFactory, count: int) -> Stats | None:
    records = factory.make_many(count)
    clock = time.perf_counter_ns
    elapsed_ns = []
    for record in records:
        t0 = clock()
        writer.submit(record)
        elapsed_ns.append(clock() - t0)
    if not await writer.flush():
        raise BenchError("the ledger database went down during the benchmark")
    return Stats.of(n / 1000 for n in elapsed_ns)


def _count(store: SqlLedgerStore) -> int:
    return store.count_usage(_EVERYTHING)[0]


_TICK_S = 0.001


async def _sustained(
    writer: LedgerWriter,
    store: SqlLedgerStore,
    factory: RecordFactory,
    seconds: float,
    rate: int | None,
) -> SustainedResult:
    rows_before = await writer.run(_count, store)
    written_before = writer.stats.num_written
    failures_before = writer.stats.num_write_failures
    clock = time.perf_counter_ns
    elapsed_ns: list[int] = []
    started = time.perf_counter()
    deadline = started + seconds
    while (now := time.perf_counter()) < deadline:
        due = 1 if rate is None else round((now - started) * rate) - len(elapsed_ns)
        for _ in range(due):
            record = factory.make()
            t0 = clock()
            writer.submit(record)
            elapsed_ns.append(clock() - t0)
        await asyncio.sleep(0 if rate is None else _TICK_S)
    produced = time.perf_counter()
    written_while_producing = writer.stats.num_written - written_before
    backlog = writer.num_pending
    flushed = await writer.flush()
    finished = time.perf_counter()
    rows_after = await writer.run(_count, store)
    return SustainedResult(
        rate=rate,
        num_submitted=len(elapsed_ns),
        num_committed=rows_after - rows_before,
        produce_s=produced - started,
        num_written_while_producing=written_while_producing,
        backlog=backlog,
        drain_s=finished - produced,
        flushed=flushed,
        num_write_failures=writer.stats.num_write_failures - failures_before,
        submit_us=Stats.of(n / 1000 for n in elapsed_ns),
    )


async def run_backend(backend: str, spec: WritesSpec, postgres_url: str | None) -> BackendResult:
    """Every step on a fresh ledger of ``backend`` (PostgreSQL: a fresh database, or the
    database at ``postgres_url``)."""
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tandem-ledger-")))
        url = stack.enter_context(postgres_database(postgres_url)) if backend != "sqlite" else None
        result = BackendResult(backend, durability(backend, url))
        factory = RecordFactory()
        store = open_store(backend, work, url)
        try:
            result.batches = await asyncio.to_thread(raw_inserts, store, factory, spec)
        finally:
            await asyncio.to_thread(store.close)
        # A store of its own: the writer closes it.
        writer_store = open_store(backend, work, url)
        result.submit_idle_us, result.sustained = await writer_runs(
            writer_store, factory, spec, work / "spool"
        )
    return result
