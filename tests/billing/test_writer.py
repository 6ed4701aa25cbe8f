"""The ledger writer: every submitted record reaches the database exactly once, through database
outages (a real PostgreSQL stopped mid-load; a simulated one on both backends), lost commit
acknowledgements, gateway restarts that leave spool segments behind, replays of segments whose
records were already committed, and segments torn by a crash."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from billing.prices import PriceCard
from billing.records import UsageRecord
from billing.sql_store import SqlLedgerStore
from billing.store import (
    AccountSettings,
    BudgetAlert,
    Cursor,
    InsertResult,
    LedgerStore,
    LedgerUnavailableError,
    RequestLogEntry,
    UsageQuery,
)
from billing.writer import LedgerWriter, WriterConfig
from tests.billing.conftest import LedgerDatabase, StoreFactory
from tests.billing.records_factory import HOUR_US, T0, make_record
from tests.billing.waiting import returns, wait_until

if TYPE_CHECKING:
    from tests.postgres_server import PostgresServer

ALL_TIME = UsageQuery(0, 2**62)


class FlakyStore:
    """A real store behind a switch: while ``down`` every call fails as an unreachable database
    does. ``lose_acks`` makes the next inserts commit and then fail (the connection dropped
    before the commit was acknowledged); ``before_insert`` runs on the ledger thread first."""

    def __init__(self, inner: LedgerStore) -> None:
        self.inner = inner
        self.down = False
        self.lose_acks = 0
        self.before_insert: Callable[[], None] | None = None

    def _check(self) -> None:
        if self.down:
            raise LedgerUnavailableError("simulated outage")

    def migrate(self) -> list[int]:
        self._check()
        return self.inner.migrate()

    def insert_usage(self, records: Sequence[UsageRecord]) -> InsertResult:
        self._check()
        if self.before_insert is not None:
            self.before_insert()
        result = self.inner.insert_usage(records)
        if self.lose_acks:
            self.lose_acks -= 1
            raise LedgerUnavailableError("simulated: connection lost after COMMIT")
        return result

    def usage_page(self, query: UsageQuery, after: Cursor | None, limit: int) -> list[UsageRecord]:
        self._check()
        return self.inner.usage_page(query, after, limit)

    def count_usage(self, query: UsageQuery) -> tuple[int, int]:
        self._check()
        return self.inner.count_usage(query)

    def spend_by_tenant(self, start_us: int, end_us: int) -> dict[str, int]:
        self._check()
        return self.inner.spend_by_tenant(start_us, end_us)

    def add_price_card(self, card: PriceCard) -> None:
        self._check()
        self.inner.add_price_card(card)

    def price_cards(self) -> list[PriceCard]:
        self._check()
        return self.inner.price_cards()

    def put_account(self, settings: AccountSettings, updated_at_us: int) -> None:
        self._check()
        self.inner.put_account(settings, updated_at_us)

    def accounts(self) -> list[AccountSettings]:
        self._check()
        return self.inner.accounts()

    def add_alert(self, alert: BudgetAlert) -> bool:
        self._check()
        return self.inner.add_alert(alert)

    def alerts(self, tenant_id: str | None, since_us: int) -> list[BudgetAlert]:
        self._check()
        return self.inner.alerts(tenant_id, since_us)

    def insert_request_log(self, entries: Sequence[RequestLogEntry]) -> None:
        self._check()
        self.inner.insert_request_log(entries)

    def request_log(
        self, tenant_id: str, start_us: int, end_us: int, limit: int
    ) -> list[RequestLogEntry]:
        self._check()
        return self.inner.request_log(tenant_id, start_us, end_us, limit)

    def purge_request_log(self, now_us: int) -> int:
        self._check()
        return self.inner.purge_request_log(now_us)

    def close(self) -> None:
        self.inner.close()


@asynccontextmanager
async def started(writer: LedgerWriter) -> AsyncIterator[LedgerWriter]:
    """``writer`` started, and closed however the block ends."""
    await writer.start()
    try:
        yield writer
    finally:
        await writer.aclose()


def config(spool_dir: Path, max_batch: int = 1000) -> WriterConfig:
    return WriterConfig(
        spool_dir=spool_dir,
        flush_interval_s=0.05,
        max_batch=max_batch,
        retry_initial_s=0.05,
        retry_max_s=0.2,
    )


def unique_records(count: int, prefix: str = "rec") -> list[UsageRecord]:
    """``count`` records with distinct ids (a few share a finish time)."""
    return [
        make_record(
            record_id=f"{prefix}-{index:05d}",
            request_id=f"chatcmpl-{prefix}-{index}",
            tenant_id=("acme", "globex", "initech")[index % 3],
            finished_at_us=T0 + HOUR_US + index // 4,
            cost_micros=100 + index,
        )
        for index in range(count)
    ]


def log_entry(record: UsageRecord) -> RequestLogEntry:
    return RequestLogEntry(
        record.record_id,
        record.request_id,
        record.tenant_id,
        record.finished_at_us,
        record.finished_at_us + HOUR_US,
        f'[{{"role": "user", "content": "prompt of {record.record_id}"}}]',
        f"output of {record.record_id}",
    )


def segments(spool_dir: Path) -> list[Path]:
    return sorted(spool_dir.glob("*.jsonl"))


def spooled_ids(spool_dir: Path) -> list[str]:
    """Record ids of every readable line of every segment."""
    ids = []
    for path in segments(spool_dir):
        for line in path.read_bytes().splitlines():
            ids.append(orjson.loads(line)["usage"]["record_id"])
    return ids


def stored(store: LedgerStore) -> list[UsageRecord]:
    records: list[UsageRecord] = []
    after: Cursor | None = None
    while True:
        page = store.usage_page(ALL_TIME, after, 500)
        records += page
        if len(page) < 500:
            return records
        after = Cursor(page[-1].finished_at_us, page[-1].record_id)


def assert_exactly_once(store: LedgerStore, records: Sequence[UsageRecord]) -> None:
    """The ledger holds these records, each once, with the values submitted, and nothing else."""
    assert store.count_usage(ALL_TIME)[0] == len(records)
    in_ledger = stored(store)
    assert len({record.record_id for record in in_ledger}) == len(in_ledger)
    by_id = {record.record_id: record for record in in_ledger}
    assert by_id == {record.record_id: record for record in records}


# --- the normal path -------------------------------------------------------------------------


async def test_flush_writes_every_record_once(ledger_store: SqlLedgerStore, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    async with started(LedgerWriter(ledger_store, config(spool, max_batch=64))) as writer:
        records = unique_records(250)
        for index, record in enumerate(records):
            writer.submit(record, log_entry(record) if index % 10 == 0 else None)
        assert writer.stats.num_submitted == 250
        assert await writer.flush() is True
        assert_exactly_once(ledger_store, records)
        assert segments(spool) == []
        assert writer.num_pending == 0
        assert writer.stats.num_written == 250
        assert (writer.stats.num_duplicates, writer.stats.num_replayed) == (0, 0)
        logs = ledger_store.request_log("acme", 0, 2**62, 1000)
        assert logs == [log_entry(r) for r in records[::10] if r.tenant_id == "acme"]
        assert await writer.flush() is True  # nothing left: a no-op
        assert writer.stats.num_written == 250


async def test_the_flusher_writes_without_being_asked(
    ledger_store: SqlLedgerStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    async with started(LedgerWriter(ledger_store, config(spool))) as writer:
        records = unique_records(40)
        for record in records:
            writer.submit(record)
        await wait_until(lambda: writer.stats.num_written == 40, "the flusher wrote 40 records")
        assert_exactly_once(ledger_store, records)
        await wait_until(lambda: not segments(spool), "the segment file was deleted")


async def test_aclose_writes_what_is_pending(store_factory: StoreFactory, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    writer = LedgerWriter(store_factory(), WriterConfig(spool, flush_interval_s=3600.0))
    await writer.start()
    records = unique_records(30)
    for record in records:
        writer.submit(record)
    await writer.aclose()
    assert_exactly_once(store_factory(), records)
    assert segments(spool) == []


# --- outages ---------------------------------------------------------------------------------


async def test_postgres_stopped_mid_load_loses_and_doubles_nothing(
    postgres_server: PostgresServer,
    ledger_database_factory: Callable[[str], LedgerDatabase],
    tmp_path: Path,
) -> None:
    database = ledger_database_factory("postgres")
    store = database.open()
    store.migrate()
    spool = tmp_path / "spool"
    writer = LedgerWriter(store, config(spool, max_batch=50))
    await writer.start()
    source = iter(unique_records(5000))
    submitted: list[UsageRecord] = []
    running = True

    async def submit(count: int) -> None:
        for _ in range(count):
            record = next(source)
            writer.submit(record, log_entry(record) if len(submitted) % 5 == 0 else None)
            submitted.append(record)
            await asyncio.sleep(0.002)  # a steady load while the flusher works

    try:
        await submit(150)
        await wait_until(lambda: writer.stats.num_written > 0, "the first batches written")
        # The server goes down while records keep arriving and batches are in flight.
        stopping = asyncio.create_task(asyncio.to_thread(postgres_server.stop))
        while not stopping.done():
            await submit(1)
        await stopping
        running = False
        submitted_while_down = len(submitted)
        await submit(150)

        assert await writer.flush() is False
        assert writer.stats.database_up is False
        assert writer.stats.num_write_failures >= 1
        assert writer.num_pending > 0
        # Whatever was submitted after the server stopped waits on disk.
        on_disk = spooled_ids(spool)
        assert len(on_disk) == len(set(on_disk))
        assert {r.record_id for r in submitted[submitted_while_down:]} <= set(on_disk)
        assert writer.num_pending == len(on_disk)

        await asyncio.to_thread(postgres_server.start)
        running = True
        assert await writer.flush() is True
        assert writer.stats.database_up is True
        assert writer.num_pending == 0
        assert segments(spool) == []
        reader = database.open()  # the test thread's old connection died with the server
        assert_exactly_once(reader, submitted)
        logs = reader.request_log("acme", 0, 2**62, 10_000)
        logs += reader.request_log("globex", 0, 2**62, 10_000)
        logs += reader.request_log("initech", 0, 2**62, 10_000)
        assert sorted(entry.record_id for entry in logs) == sorted(
            record.record_id for record in submitted[::5]
        )
    finally:
        if not running:
            postgres_server.start()
        await writer.aclose()


async def test_outage_spools_to_disk_and_replays_once(
    ledger_store: SqlLedgerStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    flaky = FlakyStore(ledger_store)
    records = unique_records(600)
    async with started(LedgerWriter(flaky, config(spool, max_batch=40))) as writer:
        for index, record in enumerate(records):
            if index == 200:
                flaky.down = True
            writer.submit(record)
            await asyncio.sleep(0.001)
        assert await writer.flush() is False
        assert writer.stats.database_up is False
        # Nothing lost meanwhile: each record is in the ledger or on disk, never in both.
        in_ledger = [record.record_id for record in stored(ledger_store)]
        on_disk = spooled_ids(spool)
        assert sorted(in_ledger + on_disk) == sorted(record.record_id for record in records)
        assert {r.record_id for r in records[200:]} <= set(on_disk)
        assert writer.num_pending == len(on_disk) > 0

        flaky.down = False
        assert await writer.flush() is True
        assert writer.stats.database_up is True
        assert_exactly_once(ledger_store, records)
        assert segments(spool) == []
        assert writer.num_pending == 0
        assert writer.stats.num_written == 600
        assert writer.stats.num_duplicates == 0


async def test_memory_stays_flat_during_an_outage(
    ledger_store: SqlLedgerStore, tmp_path: Path
) -> None:
    """While the database is down, sealed segments live on disk only: memory does not grow with
    the length of the outage."""
    spool = tmp_path / "spool"
    flaky = FlakyStore(ledger_store)
    flaky.down = True
    records = unique_records(300)
    async with started(LedgerWriter(flaky, config(spool))) as writer:
        for record in records:
            writer.submit(record)
            await asyncio.sleep(0.001)  # the flusher seals and retries meanwhile
        assert await writer.flush() is False
        sealed = list(writer._sealed)
        assert len(sealed) > 1, "the outage should have spanned several segments"
        assert [s for s in sealed if s.usage is not None or s.logs is not None] == []
        flaky.down = False
        assert await writer.flush() is True
        assert_exactly_once(ledger_store, records)


async def test_a_lost_commit_acknowledgement_does_not_double(
    ledger_store: SqlLedgerStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    flaky = FlakyStore(ledger_store)
    async with started(LedgerWriter(flaky, WriterConfig(spool, flush_interval_s=3600.0))) as writer:
        records = unique_records(80)
        for record in records:
            writer.submit(record)
        flaky.lose_acks = 1
        assert await writer.flush() is False  # committed, but the writer cannot know
        assert len(segments(spool)) == 1
        assert await writer.flush() is True  # the retry finds every record there already
        assert_exactly_once(ledger_store, records)
        assert (writer.stats.num_written, writer.stats.num_duplicates) == (0, 80)
        assert segments(spool) == []


# --- restarts --------------------------------------------------------------------------------


async def stop_with_database_down(
    store: LedgerStore, spool: Path, flushed: Sequence[UsageRecord], spooled: Sequence[UsageRecord]
) -> None:
    """A gateway that wrote ``flushed``, then lost the database and shut down with ``spooled``
    still in its spool."""
    flaky = FlakyStore(store)
    writer = LedgerWriter(flaky, WriterConfig(spool, flush_interval_s=3600.0))
    await writer.start()
    for record in flushed:
        writer.submit(record, log_entry(record))
    assert await writer.flush() is True
    flaky.down = True
    for record in spooled:
        writer.submit(record, log_entry(record))
    await writer.aclose()


async def test_restart_replays_what_the_last_process_spooled(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    records = unique_records(120)
    await stop_with_database_down(store_factory(), spool, records[:50], records[50:])
    assert sorted(spooled_ids(spool)) == [r.record_id for r in records[50:]]

    store = store_factory()
    async with started(LedgerWriter(store, config(spool))) as writer:
        # The flusher replays at start, before anything new is submitted or flushed.
        await wait_until(lambda: not segments(spool), "the old segments were replayed")
        assert await writer.flush() is True
        assert_exactly_once(store, records)
        assert writer.stats.num_replayed == 70
        assert writer.stats.num_duplicates == 0
        assert writer.stats.num_corrupt_lines == 0
        logs = [
            e for t in ("acme", "globex", "initech") for e in store.request_log(t, 0, 2**62, 999)
        ]
        assert sorted(e.record_id for e in logs) == [r.record_id for r in records]


async def test_replaying_committed_segments_inserts_nothing_twice(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    """A crash between the commit and the deletion of the segment file: the next start replays
    records the ledger has already."""
    spool, saved = tmp_path / "spool", tmp_path / "saved"
    saved.mkdir()
    records = unique_records(90)

    def save_segments() -> None:  # on the ledger thread, just before the insert commits
        for path in segments(spool):
            shutil.copy2(path, saved / path.name)

    flaky = FlakyStore(store_factory())
    flaky.before_insert = save_segments
    writer = LedgerWriter(flaky, WriterConfig(spool, flush_interval_s=3600.0, max_batch=1000))
    await writer.start()
    for record in records[:60]:
        writer.submit(record)
    assert await writer.flush() is True
    for record in records[60:]:
        writer.submit(record)
    assert await writer.flush() is True
    await writer.aclose()
    assert segments(spool) == []
    assert len(segments(saved)) == 2
    for path in segments(saved):
        shutil.copy2(path, spool / path.name)

    store = store_factory()
    async with started(LedgerWriter(store, config(spool))) as restarted:
        assert await restarted.flush() is True
        assert_exactly_once(store, records)
        assert restarted.stats.num_duplicates == 90
        assert (restarted.stats.num_written, restarted.stats.num_replayed) == (0, 0)
        assert segments(spool) == []


async def test_a_torn_last_line_is_skipped_and_counted(
    store_factory: StoreFactory, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    records = unique_records(6)
    await stop_with_database_down(store_factory(), spool, [], records)
    [segment] = segments(spool)
    # The process died in the middle of writing the last line.
    data = segment.read_bytes()
    segment.write_bytes(data[: data.rindex(b"\n", 0, len(data) - 1) + 1 + 30])

    flaky = FlakyStore(store_factory())
    flaky.down = True  # the database is still down when the gateway comes back
    async with started(LedgerWriter(flaky, config(spool))) as writer:
        assert await writer.flush() is False
        assert await writer.flush() is False
        assert writer.num_pending == 5
        flaky.down = False
        assert await writer.flush() is True
        assert writer.stats.num_corrupt_lines == 1  # counted once, however many retries
        assert writer.stats.num_replayed == 5
        assert_exactly_once(flaky.inner, records[:5])
        assert segments(spool) == []


async def test_records_the_spool_could_not_take_survive_an_outage_in_memory(
    ledger_store: SqlLedgerStore, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    flaky = FlakyStore(ledger_store)
    async with started(LedgerWriter(flaky, WriterConfig(spool, flush_interval_s=3600.0))) as writer:
        shutil.rmtree(spool)  # the segment file cannot be created
        flaky.down = True
        records = unique_records(10)
        for record in records:
            writer.submit(record)
        assert writer.stats.num_spool_errors == 1
        assert await writer.flush() is False
        flaky.down = False
        assert await writer.flush() is True
        assert_exactly_once(ledger_store, records)


async def test_aclose_right_after_a_full_batch_woke_the_flusher(
    ledger_store: SqlLedgerStore, tmp_path: Path
) -> None:
    """The wake-up and the cancellation land in the same loop iteration: the cancellation must
    not be lost (asyncio.wait_for on Python 3.11 returns the finished wait instead)."""
    spool = tmp_path / "spool"
    writer = LedgerWriter(ledger_store, WriterConfig(spool, flush_interval_s=3600.0, max_batch=5))
    await writer.start()
    await asyncio.sleep(0.01)  # the flusher is waiting for its interval
    records = unique_records(5)
    for record in records:
        writer.submit(record)  # the fifth fills the batch and wakes the flusher
    await returns(writer.aclose(), "aclose")
    assert_exactly_once(ledger_store, records)
