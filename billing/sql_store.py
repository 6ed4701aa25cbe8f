"""The ledger on SQL: SQLite (embedded default, WAL) and PostgreSQL, one implementation.

Both run the same statements (written with ``?`` placeholders; PostgreSQL's driver gets ``%s``)
and the same migrations. Each thread that calls a store gets its own connection, opened on
first use and dropped when the database fails, so the next call reconnects: the writer thread
and the readers (exports, budgets) never share one. Driver errors that mean "cannot reach the
database" become ``LedgerUnavailableError``; anything else is a bug and propagates.
"""

from __future__ import annotations

import abc
import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path
from typing import Any

from billing.migrations import CREATE_MIGRATIONS_TABLE, MIGRATIONS, MIGRATIONS_TABLE
from billing.prices import PriceCard
from billing.records import COLUMNS, UsageRecord
from billing.store import (
    AccountSettings,
    BudgetAlert,
    Cursor,
    InsertResult,
    LedgerError,
    LedgerUnavailableError,
    PriceConflictError,
    RequestLogEntry,
    UsageQuery,
)
from core.sqlite import enable_wal

_INSERT_USAGE = (
    f"INSERT INTO tandem_usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)}) "
    "ON CONFLICT (record_id) DO NOTHING"
)
_SELECT_USAGE = f"SELECT {', '.join(COLUMNS)} FROM tandem_usage"
_CHECK_AFTER_IDLE_S = 1.0
"""A connection idle longer is checked before use: after a database restart the first call on
each thread would otherwise fail once (an export answered 503) before reconnecting."""
_REQUEST_LOG_COLUMNS = (
    "record_id, request_id, tenant_id, created_at_us, expires_at_us, prompt, output"
)


class SqlLedgerStore(abc.ABC):
    """``LedgerStore`` over a DB-API connection; subclasses supply the dialect."""

    placeholder = "?"

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[Any] = []

    # -- dialect ---------------------------------------------------------------------------

    @abc.abstractmethod
    def _connect(self) -> Any:
        """A new connection in autocommit mode (transactions are explicit)."""

    @abc.abstractmethod
    def _transaction(self, connection: Any) -> Any:
        """A context manager around one transaction on ``connection``."""

    @abc.abstractmethod
    def _is_unavailable(self, exc: BaseException) -> bool:
        """The error means the database cannot be reached now (retry later)."""

    @abc.abstractmethod
    def _is_conflict(self, exc: BaseException) -> bool:
        """The error is a unique-key violation."""

    def _lock_migrations(self, cursor: Any) -> None:  # noqa: B027 - optional hook
        """Keep two gateways from migrating at once (inside the migration transaction); SQLite's
        ``BEGIN IMMEDIATE`` already does."""

    # -- plumbing --------------------------------------------------------------------------

    def _sql(self, statement: str) -> str:
        return statement if self.placeholder == "?" else statement.replace("?", self.placeholder)

    def _is_alive(self, connection: Any) -> bool:
        """A connection idle for a while still reaches the database (a restarted server
        closed it); True when the backend cannot go away underneath it."""
        return True

    def _connection(self) -> Any:
        connection = getattr(self._local, "connection", None)
        now = time.monotonic()
        idle_s = now - getattr(self._local, "used_at", now)
        if (
            connection is not None
            and idle_s > _CHECK_AFTER_IDLE_S
            and not self._is_alive(connection)
        ):
            self._drop_connection()
            connection = None
        self._local.used_at = now
        if connection is None:
            try:
                connection = self._connect()
            except Exception as exc:
                if self._is_unavailable(exc):
                    raise LedgerUnavailableError(f"cannot open the ledger database: {exc}") from exc
                raise
            self._local.connection = connection
            with self._lock:
                self._connections.append(connection)
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        self._local.connection = None
        if connection is None:
            return
        with self._lock:
            if connection in self._connections:
                self._connections.remove(connection)
        with contextlib.suppress(Exception):  # a broken connection may fail to close
            connection.close()

    @contextmanager
    def _cursor(self, transaction: bool = False) -> Iterator[Any]:
        """A cursor on this thread's connection; unavailability becomes
        ``LedgerUnavailableError`` and drops the connection so the next call reconnects."""
        connection = self._connection()
        try:
            if transaction:
                with self._transaction(connection):
                    yield connection.cursor()
            else:
                yield connection.cursor()
        except LedgerError:
            raise
        except Exception as exc:
            if self._is_unavailable(exc):
                self._drop_connection()
                raise LedgerUnavailableError(f"the ledger database failed: {exc}") from exc
            if self._is_conflict(exc):
                raise PriceConflictError(str(exc)) from exc
            raise

    # -- LedgerStore -----------------------------------------------------------------------

    def migrate(self) -> list[int]:
        applied: list[int] = []
        with self._cursor(transaction=True) as cursor:
            self._lock_migrations(cursor)
            cursor.execute(CREATE_MIGRATIONS_TABLE)
            cursor.execute(f"SELECT version FROM {MIGRATIONS_TABLE}")
            done = {int(row[0]) for row in cursor.fetchall()}
            for migration in MIGRATIONS:
                if migration.version in done:
                    continue
                for statement in migration.statements:
                    cursor.execute(statement)
                cursor.execute(
                    self._sql(
                        f"INSERT INTO {MIGRATIONS_TABLE} (version, name, applied_at_us) "
                        "VALUES (?, ?, ?)"
                    ),
                    (migration.version, migration.name, time.time_ns() // 1000),
                )
                applied.append(migration.version)
        return applied

    def insert_usage(self, records: Sequence[UsageRecord]) -> InsertResult:
        if not records:
            return InsertResult()
        rows = [_usage_row(record) for record in records]
        with self._cursor(transaction=True) as cursor:
            cursor.executemany(self._sql(_INSERT_USAGE), rows)
            num_inserted = max(cursor.rowcount, 0)
        return InsertResult(
            num_inserted=num_inserted,
            num_duplicates=len(records) - num_inserted,
            ids=[record.record_id for record in records],
        )

    def usage_page(self, query: UsageQuery, after: Cursor | None, limit: int) -> list[UsageRecord]:
        where, params = _usage_where(query)
        if after is not None:
            where += " AND (finished_at_us > ? OR (finished_at_us = ? AND record_id > ?))"
            params += [after.finished_at_us, after.finished_at_us, after.record_id]
        statement = f"{_SELECT_USAGE} WHERE {where} ORDER BY finished_at_us, record_id LIMIT ?"
        with self._cursor() as cursor:
            cursor.execute(self._sql(statement), [*params, limit])
            return [_usage_record(row) for row in cursor.fetchall()]

    def count_usage(self, query: UsageQuery) -> tuple[int, int]:
        where, params = _usage_where(query)
        statement = (
            f"SELECT COUNT(*), COALESCE(SUM(cost_micros), 0) FROM tandem_usage WHERE {where}"
        )
        with self._cursor() as cursor:
            cursor.execute(self._sql(statement), params)
            count, total = cursor.fetchone()
        return int(count), int(total)

    def spend_by_tenant(self, start_us: int, end_us: int) -> dict[str, int]:
        statement = (
            "SELECT tenant_id, SUM(cost_micros) FROM tandem_usage "
            "WHERE finished_at_us >= ? AND finished_at_us < ? GROUP BY tenant_id"
        )
        with self._cursor() as cursor:
            cursor.execute(self._sql(statement), (start_us, end_us))
            return {str(tenant): int(total) for tenant, total in cursor.fetchall()}

    def add_price_card(self, card: PriceCard) -> None:
        statement = (
            "INSERT INTO tandem_price_cards (model_version, effective_from_us, input_per_1k, "
            "output_per_1k, cached_input_per_1k, currency) VALUES (?, ?, ?, ?, ?, ?)"
        )
        values = (
            card.model_version, card.effective_from_us, format(card.input_per_1k, "f"),
            format(card.output_per_1k, "f"), format(card.cached_input_per_1k, "f"), card.currency,
        )  # fmt: skip
        with self._cursor(transaction=True) as cursor:
            cursor.execute(self._sql(statement), values)

    def price_cards(self) -> list[PriceCard]:
        statement = (
            "SELECT model_version, effective_from_us, input_per_1k, output_per_1k, "
            "cached_input_per_1k, currency FROM tandem_price_cards "
            "ORDER BY model_version, effective_from_us"
        )
        with self._cursor() as cursor:
            cursor.execute(statement)
            return [
                PriceCard(
                    model_version=str(version),
                    effective_from_us=int(effective),
                    input_per_1k=Decimal(str(input_price)),
                    output_per_1k=Decimal(str(output_price)),
                    cached_input_per_1k=Decimal(str(cached_price)),
                    currency=str(currency),
                )
                for version, effective, input_price, output_price, cached_price, currency in (
                    cursor.fetchall()
                )
            ]

    def put_account(self, settings: AccountSettings, updated_at_us: int) -> None:
        statement = (
            "INSERT INTO tandem_billing_accounts (tenant_id, monthly_budget_micros, "
            "alert_thresholds_pct, request_log, request_log_retention_s, updated_at_us) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant_id) DO UPDATE SET "
            "monthly_budget_micros = excluded.monthly_budget_micros, "
            "alert_thresholds_pct = excluded.alert_thresholds_pct, "
            "request_log = excluded.request_log, "
            "request_log_retention_s = excluded.request_log_retention_s, "
            "updated_at_us = excluded.updated_at_us"
        )
        values = (
            settings.tenant_id,
            settings.monthly_budget_micros,
            ",".join(str(pct) for pct in settings.alert_thresholds_pct),
            settings.request_log,
            settings.request_log_retention_s,
            updated_at_us,
        )
        with self._cursor(transaction=True) as cursor:
            cursor.execute(self._sql(statement), values)

    def accounts(self) -> list[AccountSettings]:
        statement = (
            "SELECT tenant_id, monthly_budget_micros, alert_thresholds_pct, request_log, "
            "request_log_retention_s FROM tandem_billing_accounts ORDER BY tenant_id"
        )
        with self._cursor() as cursor:
            cursor.execute(statement)
            return [
                AccountSettings(
                    tenant_id=str(tenant),
                    monthly_budget_micros=None if budget is None else int(budget),
                    alert_thresholds_pct=tuple(int(pct) for pct in str(levels).split(",") if pct),
                    request_log=bool(request_log),
                    request_log_retention_s=int(retention),
                )
                for tenant, budget, levels, request_log, retention in cursor.fetchall()
            ]

    def add_alert(self, alert: BudgetAlert) -> bool:
        statement = (
            "INSERT INTO tandem_budget_alerts (tenant_id, month, threshold_pct, spend_micros, "
            "budget_micros, fired_at_us) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (tenant_id, month, threshold_pct) DO NOTHING"
        )
        values = (
            alert.tenant_id, alert.month, alert.threshold_pct, alert.spend_micros,
            alert.budget_micros, alert.fired_at_us,
        )  # fmt: skip
        with self._cursor(transaction=True) as cursor:
            cursor.execute(self._sql(statement), values)
            return bool(cursor.rowcount)

    def alerts(self, tenant_id: str | None, since_us: int) -> list[BudgetAlert]:
        statement = (
            "SELECT tenant_id, month, threshold_pct, spend_micros, budget_micros, fired_at_us "
            "FROM tandem_budget_alerts WHERE fired_at_us >= ?"
        )
        params: list[Any] = [since_us]
        if tenant_id is not None:
            statement += " AND tenant_id = ?"
            params.append(tenant_id)
        statement += " ORDER BY fired_at_us, tenant_id, threshold_pct"
        with self._cursor() as cursor:
            cursor.execute(self._sql(statement), params)
            return [
                BudgetAlert(str(t), str(m), int(p), int(s), int(b), int(f))
                for t, m, p, s, b, f in cursor.fetchall()
            ]

    def insert_request_log(self, entries: Sequence[RequestLogEntry]) -> None:
        if not entries:
            return
        statement = (
            f"INSERT INTO tandem_request_log ({_REQUEST_LOG_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (record_id) DO NOTHING"
        )
        rows = [
            (e.record_id, e.request_id, e.tenant_id, e.created_at_us, e.expires_at_us, e.prompt,
             e.output)
            for e in entries
        ]  # fmt: skip
        with self._cursor(transaction=True) as cursor:
            cursor.executemany(self._sql(statement), rows)

    def request_log(
        self, tenant_id: str, start_us: int, end_us: int, limit: int
    ) -> list[RequestLogEntry]:
        statement = (
            f"SELECT {_REQUEST_LOG_COLUMNS} FROM tandem_request_log WHERE tenant_id = ? "
            "AND created_at_us >= ? AND created_at_us < ? ORDER BY created_at_us, record_id LIMIT ?"
        )
        with self._cursor() as cursor:
            cursor.execute(self._sql(statement), (tenant_id, start_us, end_us, limit))
            return [
                RequestLogEntry(str(r), str(q), str(t), int(c), int(x), str(p), str(o))
                for r, q, t, c, x, p, o in cursor.fetchall()
            ]

    def purge_request_log(self, now_us: int) -> int:
        with self._cursor(transaction=True) as cursor:
            cursor.execute(
                self._sql("DELETE FROM tandem_request_log WHERE expires_at_us <= ?"), (now_us,)
            )
            return max(int(cursor.rowcount), 0)

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            with contextlib.suppress(Exception):  # a dead connection may fail to close
                connection.close()
        self._local = threading.local()


class SqliteLedgerStore(SqlLedgerStore):
    """The embedded default: one SQLite file in WAL mode (readers never block the writer)."""

    def __init__(self, path: Path, busy_timeout_s: float = 5.0) -> None:
        super().__init__()
        self.path = path
        self._busy_timeout_s = busy_timeout_s

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(
            self.path, timeout=self._busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        # Two gateways starting on one new ledger switch it to WAL at the same moment.
        enable_wal(connection, self._busy_timeout_s)
        # FULL: a committed batch survives power loss, so its spool file may be deleted.
        connection.execute("PRAGMA synchronous=FULL")
        return connection

    @contextmanager
    def _transaction(self, connection: Any) -> Iterator[None]:
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    def _is_unavailable(self, exc: BaseException) -> bool:
        # Locked past the busy timeout, disk I/O errors, a file that cannot be opened.
        return isinstance(exc, sqlite3.OperationalError)

    def _is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.IntegrityError)


class PostgresLedgerStore(SqlLedgerStore):
    """PostgreSQL (psycopg 3), for a ledger shared by several gateways."""

    placeholder = "%s"

    def __init__(self, url: str, connect_timeout_s: float = 5.0) -> None:
        super().__init__()
        self.url = url
        self._connect_timeout_s = connect_timeout_s

    def _connect(self) -> Any:
        import psycopg

        return psycopg.connect(
            self.url, autocommit=True, connect_timeout=max(1, round(self._connect_timeout_s))
        )

    def _transaction(self, connection: Any) -> Any:
        return connection.transaction()

    def _is_alive(self, connection: Any) -> bool:
        try:
            connection.execute("SELECT 1")
        except Exception as exc:
            if self._is_unavailable(exc):
                return False
            raise
        return True

    def _lock_migrations(self, cursor: Any) -> None:
        cursor.execute("SELECT pg_advisory_xact_lock(7061726)")  # an arbitrary, fixed key

    def _is_unavailable(self, exc: BaseException) -> bool:
        import psycopg

        return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)

    def _is_conflict(self, exc: BaseException) -> bool:
        import psycopg

        return isinstance(exc, psycopg.errors.UniqueViolation)


def open_store(database_url: str | None, sqlite_path: Path) -> SqlLedgerStore:
    """PostgreSQL when ``database_url`` is set (``postgresql://...``), else the SQLite file."""
    if database_url is None:
        return SqliteLedgerStore(sqlite_path)
    if database_url.startswith(("postgresql://", "postgres://")):
        return PostgresLedgerStore(database_url)
    if database_url.startswith("sqlite:///"):
        return SqliteLedgerStore(Path(database_url.removeprefix("sqlite:///")))
    raise LedgerError(
        f"unsupported billing database URL {database_url!r}: use postgresql://user@host/db "
        "or sqlite:///path/to/ledger.db"
    )


def _usage_where(query: UsageQuery) -> tuple[str, list[Any]]:
    where = "finished_at_us >= ? AND finished_at_us < ?"
    params: list[Any] = [query.start_us, query.end_us]
    if query.tenant_id is not None:
        where += " AND tenant_id = ?"
        params.append(query.tenant_id)
    return where, params


def _usage_row(record: UsageRecord) -> tuple[Any, ...]:
    row = record.to_dict()
    return tuple(row[column] for column in COLUMNS)


def _usage_record(row: Sequence[Any]) -> UsageRecord:
    return UsageRecord.from_dict(dict(zip(COLUMNS, row, strict=True)))
