"""The ledger store, the same tests on SQLite and PostgreSQL: migrations, exactly-once inserts,
keyset pages, sums, price cards, accounts, alerts and the request log; and both backends
reading back identical values."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from decimal import Decimal
from pathlib import Path

import pytest

from billing.migrations import MIGRATIONS, MIGRATIONS_TABLE
from billing.prices import PriceCard
from billing.records import UsageRecord
from billing.sql_store import SqliteLedgerStore, SqlLedgerStore
from billing.store import (
    AccountSettings,
    BudgetAlert,
    Cursor,
    LedgerUnavailableError,
    PriceConflictError,
    RequestLogEntry,
    UsageQuery,
)
from tests.billing.conftest import LedgerDatabase, StoreFactory
from tests.billing.records_factory import (
    DAY_US,
    HOUR_US,
    NOVEMBER_US,
    T0,
    make_record,
    make_records,
)

ALL_TIME = UsageQuery(0, 2**62)


def read_all(
    store: SqlLedgerStore, query: UsageQuery = ALL_TIME, limit: int = 7
) -> list[UsageRecord]:
    """Every record of ``query``, page by page (keyset on (finished_at_us, record_id))."""
    records: list[UsageRecord] = []
    after: Cursor | None = None
    while True:
        page = store.usage_page(query, after, limit)
        assert len(page) <= limit
        records += page
        if len(page) < limit:
            return records
        after = Cursor(page[-1].finished_at_us, page[-1].record_id)


def store_order(records: list[UsageRecord]) -> list[UsageRecord]:
    return sorted(records, key=lambda record: (record.finished_at_us, record.record_id))


# --- migrations ------------------------------------------------------------------------------


def test_migrate_applies_every_migration_once_and_records_it(
    ledger_database: LedgerDatabase,
) -> None:
    store = ledger_database.open()
    assert store.migrate() == [migration.version for migration in MIGRATIONS]
    assert store.migrate() == []
    # A restarted gateway on the same database finds nothing to do.
    assert ledger_database.open().migrate() == []
    rows = ledger_database.query(f"SELECT version, name, applied_at_us FROM {MIGRATIONS_TABLE}")
    assert sorted((int(v), str(n)) for v, n, _ in rows) == [(m.version, m.name) for m in MIGRATIONS]
    assert all(int(applied) > 0 for _, _, applied in rows)


def test_concurrent_migrations_apply_once(ledger_database: LedgerDatabase) -> None:
    """Two gateways starting together on an empty database: one migrates, the other waits."""
    stores = [ledger_database.open() for _ in range(2)]
    applied: list[list[int]] = []
    barrier = threading.Barrier(len(stores))

    def migrate(store: SqlLedgerStore) -> None:
        barrier.wait()
        applied.append(store.migrate())

    threads = [threading.Thread(target=migrate, args=(store,)) for store in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(applied) == [[], [migration.version for migration in MIGRATIONS]]
    assert len(ledger_database.query(f"SELECT version FROM {MIGRATIONS_TABLE}")) == len(MIGRATIONS)


def test_gateways_opening_one_new_sqlite_ledger_together_are_not_refused(tmp_path: Path) -> None:
    """Switching a new SQLite file to WAL is refused at once ("database is locked", no busy
    wait) to a second connection switching at the same moment: seen in about one round in
    twenty without ``core.sqlite.enable_wal``'s wait, so a hundred rounds make the race show."""

    def open_ledger(
        store: SqliteLedgerStore, barrier: threading.Barrier, errors: list[str]
    ) -> None:
        barrier.wait()
        try:
            store.migrate()
        except LedgerUnavailableError as exc:
            errors.append(str(exc))

    for round_number in range(100):
        path = tmp_path / f"ledger-{round_number}.db"
        stores = [SqliteLedgerStore(path) for _ in range(2)]
        barrier = threading.Barrier(len(stores))
        errors: list[str] = []
        threads = [
            threading.Thread(target=open_ledger, args=(store, barrier, errors)) for store in stores
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for store in stores:
            store.close()
        assert errors == [], f"round {round_number}: {errors}"


# --- usage -----------------------------------------------------------------------------------


def test_insert_ignores_record_ids_already_in_the_ledger(ledger_store: SqlLedgerStore) -> None:
    records = make_records(50)
    first = ledger_store.insert_usage(records[:30])
    assert (first.num_inserted, first.num_duplicates) == (30, 0)
    # A replayed batch overlapping the first: only the 20 new records go in.
    second = ledger_store.insert_usage(records[10:])
    assert (second.num_inserted, second.num_duplicates) == (20, 20)
    assert second.ids == [record.record_id for record in records[10:]]
    # A duplicate keeps the first version: a retry with another cost does not rewrite it.
    changed = replace(records[0], cost_micros=records[0].cost_micros + 1_000_000)
    third = ledger_store.insert_usage([changed])
    assert (third.num_inserted, third.num_duplicates) == (0, 1)
    assert read_all(ledger_store) == records
    assert ledger_store.insert_usage([]).num_inserted == 0


def test_usage_pages_are_ordered_and_complete_across_ties(ledger_store: SqlLedgerStore) -> None:
    # Twelve records end in the same microsecond: a page boundary must fall inside the tie.
    tie = [
        make_record(record_id=f"tie-{index:02d}", finished_at_us=T0 + HOUR_US)
        for index in (7, 3, 11, 0, 5, 9, 1, 10, 2, 8, 4, 6)
    ]
    records = [*make_records(200), *tie]
    ledger_store.insert_usage(records[::-1])  # insertion order must not matter
    expected = store_order(records)
    for limit in (1, 5, 7, 212, 500):
        assert read_all(ledger_store, limit=limit) == expected
    page = ledger_store.usage_page(ALL_TIME, Cursor(T0 + HOUR_US, "tie-04"), 3)
    assert [record.record_id for record in page] == ["tie-05", "tie-06", "tie-07"]


def test_usage_query_bounds_and_tenant_filter(ledger_store: SqlLedgerStore) -> None:
    start, end = NOVEMBER_US, NOVEMBER_US + DAY_US
    edges = [
        make_record(record_id="before", finished_at_us=start - 1),
        make_record(record_id="at-start", finished_at_us=start),
        make_record(record_id="last", finished_at_us=end - 1),
        make_record(record_id="at-end", finished_at_us=end),
        make_record(record_id="other-tenant", tenant_id="globex", finished_at_us=start + 5),
    ]
    ledger_store.insert_usage(edges)
    in_day = read_all(ledger_store, UsageQuery(start, end))
    assert [record.record_id for record in in_day] == ["at-start", "other-tenant", "last"]
    acme = read_all(ledger_store, UsageQuery(start, end, tenant_id="acme"))
    assert [record.record_id for record in acme] == ["at-start", "last"]
    assert read_all(ledger_store, UsageQuery(start, end, tenant_id="nobody")) == []


def test_count_usage_and_spend_by_tenant(ledger_store: SqlLedgerStore) -> None:
    records = make_records(300)
    ledger_store.insert_usage(records)
    assert ledger_store.count_usage(ALL_TIME) == (300, sum(r.cost_micros for r in records))
    start, end = NOVEMBER_US, NOVEMBER_US + 2 * DAY_US
    november = [r for r in records if start <= r.finished_at_us < end]
    assert november and len(november) < len(records)
    assert ledger_store.count_usage(UsageQuery(start, end)) == (
        len(november),
        sum(r.cost_micros for r in november),
    )
    globex = [r for r in november if r.tenant_id == "globex"]
    assert ledger_store.count_usage(UsageQuery(start, end, "globex")) == (
        len(globex),
        sum(r.cost_micros for r in globex),
    )
    expected: dict[str, int] = {}
    for record in november:
        expected[record.tenant_id] = expected.get(record.tenant_id, 0) + record.cost_micros
    assert ledger_store.spend_by_tenant(start, end) == expected
    assert ledger_store.count_usage(UsageQuery(0, 1)) == (0, 0)
    assert ledger_store.spend_by_tenant(0, 1) == {}


# --- price cards -----------------------------------------------------------------------------


def test_price_cards_round_trip_exactly_and_conflict(ledger_store: SqlLedgerStore) -> None:
    cards = [
        PriceCard("m@2", T0, Decimal("0.0000375"), Decimal("0.00015"), Decimal("0")),
        PriceCard("m@1", T0 + DAY_US, Decimal("0.1"), Decimal("12.5"), Decimal("0.05"), "EUR"),
        PriceCard("m@1", T0, Decimal("0.00000001"), Decimal("999.999999"), Decimal("1")),
    ]
    for card in cards:
        ledger_store.add_price_card(card)
    stored = ledger_store.price_cards()
    assert stored == sorted(cards, key=lambda card: (card.model_version, card.effective_from_us))
    # Equal Decimals may differ in form (0.1 == 0.10): the digits must survive too.
    digits = [
        (str(c.input_per_1k), str(c.output_per_1k), str(c.cached_input_per_1k)) for c in stored
    ]
    assert digits == [
        ("1E-8", "999.999999", "1"),  # str(Decimal("0.00000001")): the same exact number
        ("0.1", "12.5", "0.05"),
        ("0.0000375", "0.00015", "0"),
    ]
    by_key = {(c.model_version, c.effective_from_us): c for c in stored}
    assert str(by_key["m@2", T0].input_per_1k) == "0.0000375"
    assert str(by_key["m@1", T0 + DAY_US].output_per_1k) == "12.5"
    assert by_key["m@1", T0].input_per_1k == Decimal("1E-8")

    with pytest.raises(PriceConflictError):
        ledger_store.add_price_card(replace(cards[0], input_per_1k=Decimal("1")))
    assert ledger_store.price_cards() == stored  # the conflict changed nothing
    ledger_store.add_price_card(replace(cards[0], effective_from_us=T0 + 1))  # still usable


# --- accounts and alerts ---------------------------------------------------------------------


def test_accounts_upsert_and_list(ledger_store: SqlLedgerStore) -> None:
    assert ledger_store.accounts() == []
    acme = AccountSettings("acme", 25_000_000, (50, 80, 100), True, 3600)
    globex = AccountSettings("globex")
    initech = AccountSettings("initech", 0, (), False, 1)
    for account in (acme, globex, initech):
        ledger_store.put_account(account, updated_at_us=T0)
    assert ledger_store.accounts() == [acme, globex, initech]
    changed = AccountSettings("acme", None, (90,), False, 60)
    ledger_store.put_account(changed, updated_at_us=T0 + 1)
    assert ledger_store.accounts() == [changed, globex, initech]
    assert all(type(account.request_log) is bool for account in ledger_store.accounts())


def test_alerts_fire_once_per_tenant_month_and_threshold(ledger_store: SqlLedgerStore) -> None:
    first = BudgetAlert("acme", "2026-11", 50, 500, 1000, T0 + 10)
    assert ledger_store.add_alert(first) is True
    # Another gateway crossing the same level later: not stored again.
    assert ledger_store.add_alert(replace(first, spend_micros=600, fired_at_us=T0 + 20)) is False
    assert ledger_store.add_alert(replace(first, threshold_pct=80, fired_at_us=T0 + 5)) is True
    assert ledger_store.add_alert(replace(first, month="2026-12", fired_at_us=T0 + 30)) is True
    assert ledger_store.add_alert(replace(first, tenant_id="globex", fired_at_us=T0 + 10)) is True
    everyone = ledger_store.alerts(None, 0)
    assert [(a.tenant_id, a.month, a.threshold_pct, a.fired_at_us) for a in everyone] == [
        ("acme", "2026-11", 80, T0 + 5),
        ("acme", "2026-11", 50, T0 + 10),
        ("globex", "2026-11", 50, T0 + 10),
        ("acme", "2026-12", 50, T0 + 30),
    ]
    assert everyone[1] == first
    assert [a.threshold_pct for a in ledger_store.alerts("acme", T0 + 10)] == [50, 50]
    assert ledger_store.alerts("initech", 0) == []


# --- request log -----------------------------------------------------------------------------


def entry(
    record_id: str, tenant_id: str, created_at_us: int, ttl_us: int = HOUR_US
) -> RequestLogEntry:
    return RequestLogEntry(
        record_id,
        f"chatcmpl-{record_id}",
        tenant_id,
        created_at_us,
        created_at_us + ttl_us,
        '[{"role": "user", "content": "héllo [EMAIL]"}]',
        "bonjour ✓",
    )


def test_request_log_insert_query_and_purge(ledger_store: SqlLedgerStore) -> None:
    entries = [
        entry("r3", "acme", T0 + 30),
        entry("r1", "acme", T0 + 10),
        entry("r2", "acme", T0 + 20, ttl_us=10 * HOUR_US),
        entry("g1", "globex", T0 + 15),
    ]
    ledger_store.insert_request_log(entries)
    ledger_store.insert_request_log([replace(entries[0], output="rewritten")])  # ignored
    ledger_store.insert_request_log([])
    acme = ledger_store.request_log("acme", T0, T0 + DAY_US, 100)
    assert acme == [entries[1], entries[2], entries[0]]
    assert ledger_store.request_log("acme", T0 + 10, T0 + 30, 100) == [entries[1], entries[2]]
    assert ledger_store.request_log("acme", T0, T0 + DAY_US, 1) == [entries[1]]
    assert ledger_store.request_log("globex", T0, T0 + DAY_US, 100) == [entries[3]]

    # Expiry is inclusive: an entry is gone at its expires_at_us, not a microsecond before.
    assert ledger_store.purge_request_log(T0 + 10 + HOUR_US - 1) == 0
    assert ledger_store.purge_request_log(T0 + 10 + HOUR_US) == 1
    assert ledger_store.purge_request_log(T0 + 30 + HOUR_US) == 2
    assert ledger_store.request_log("acme", T0, T0 + DAY_US, 100) == [entries[2]]
    assert ledger_store.request_log("globex", T0, T0 + DAY_US, 100) == []


def test_stores_on_one_database_see_each_other(store_factory: StoreFactory) -> None:
    writer, reader = store_factory(), store_factory()
    records = make_records(20)
    writer.insert_usage(records)
    assert read_all(reader) == records
    assert reader.insert_usage(records).num_duplicates == 20


# --- both backends ---------------------------------------------------------------------------


def test_both_backends_hold_identical_values(
    ledger_database_factory: Callable[[str], LedgerDatabase],
) -> None:
    records = make_records(400)
    assert any(r.key_id is None for r in records) and any(r.ttft_us is None for r in records)
    cards = [PriceCard("m@1", T0, Decimal("0.0000375"), Decimal("0.0006"), Decimal("0.000075"))]
    accounts = [AccountSettings("acme", 10**15, (1, 99), True, 60), AccountSettings("globex")]
    alerts = [BudgetAlert("acme", "2026-11", 99, 2**53 + 1, 10**15, T0)]
    logs = [entry("r1", "acme", T0)]
    read_back = []
    for backend in ("sqlite", "postgres"):
        store = ledger_database_factory(backend).open()
        store.migrate()
        store.insert_usage(records)
        for card in cards:
            store.add_price_card(card)
        for account in accounts:
            store.put_account(account, T0)
        for alert in alerts:
            store.add_alert(alert)
        store.insert_request_log(logs)
        values = (
            read_all(store, limit=64),
            store.count_usage(ALL_TIME),
            store.spend_by_tenant(T0, NOVEMBER_US),
            store.price_cards(),
            [str(card.input_per_1k) for card in store.price_cards()],
            store.accounts(),
            store.alerts(None, 0),
            store.request_log("acme", 0, 2**62, 10),
        )
        read_back.append(values)
    assert read_back[0] == read_back[1]
    usage, _, _, stored_cards, prices, stored_accounts, stored_alerts, stored_logs = read_back[0]
    assert usage == records
    assert (stored_cards, prices) == (cards, ["0.0000375"])
    assert (stored_accounts, stored_alerts, stored_logs) == (accounts, alerts, logs)
