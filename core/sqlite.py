"""The plumbing of the stores that keep a local SQLite file: ``SqliteFile`` and ``transaction``
(tenant registry, versions store), and ``enable_wal``, the step on connect they share with the
ledger.

Lifecycle: ``SqliteFile(path, ...)`` does no I/O. ``await start()`` opens the file (creating its
parent folders, switching to WAL and migrating the schema) so that a bad path fails at startup;
a file not started opens itself on its first ``run``. ``aclose()`` closes it for good.

Threading: every ``run`` calls its work on the file's own thread, over one connection; a
``threading.Lock`` taken inside the thread serializes them (an ``asyncio.Lock`` would be
released by a cancelled caller while its thread still used the connection). The thread is the
file's, not the event loop's shared pool: a store call never waits behind unrelated blocking
work (an export, a tokenizer load), and such work can never take the thread a key lookup needs.
Writes run in ``transaction(conn)``, a ``BEGIN IMMEDIATE`` transaction, so a second process on
the same file (a CLI beside the gateway, a second gateway) waits for the write lock instead of
interleaving a read-then-write; WAL lets its readers proceed meanwhile, and they see every
committed change on their next read.

Errors: a ``sqlite3`` or OS error becomes the store's own "unavailable" exception, which the
store passes in (``core`` imports nothing above it). ``IntegrityError`` and ``ProgrammingError``
are left as they are: they are bugs of the store, not an unavailable file.

Schema: the version lives in ``PRAGMA user_version``; ``migrations[n]`` takes version ``n`` to
``n + 1``, all of them in one transaction. A file from a newer gateway is refused rather than
misread.

The only module of ``core`` that touches I/O.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

_T = TypeVar("_T")

_RETRY_PAUSE_S = 0.01

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another process's write lock before giving up."""


class SqliteFile:
    """One SQLite file of a store, used through one connection; see the module docstring."""

    def __init__(
        self,
        path: Path,
        *,
        what: str,
        migrations: Sequence[tuple[str, ...]],
        unavailable: Callable[[str], Exception],
        pragmas: tuple[str, ...] = (),
        busy_timeout_s: float = BUSY_TIMEOUT_S,
    ) -> None:
        """``what`` names the store in messages ("tenant registry": "tenant registry <path> is
        closed"). ``migrations[n]`` holds the statements taking schema version ``n`` to
        ``n + 1``. ``unavailable`` makes the exception raised, from its message, when the file
        cannot be used. ``pragmas`` are statements run on every new connection before
        migrating (per-connection settings such as ``PRAGMA foreign_keys = ON``)."""
        self._path = path
        self._what = what
        self._migrations = tuple(migrations)
        self._unavailable = unavailable
        self._pragmas = pragmas
        self._busy_timeout_s = busy_timeout_s
        self._conn: sqlite3.Connection | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sqlite {what}")

    @property
    def path(self) -> Path:
        """The file."""
        return self._path

    @property
    def schema_version(self) -> int:
        """The ``user_version`` this file is migrated to: the number of migrations."""
        return len(self._migrations)

    async def start(self) -> None:
        """Open the file now (folders, WAL, schema); the unavailable error if it cannot be."""
        await self.run(_nothing)

    async def run(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """``work(conn)`` in a worker thread, alone on the connection (opened on first use);
        its result, or the unavailable error for a ``sqlite3`` or OS error."""
        if self._closed:
            raise self._unavailable(f"{self._what} {self._path} is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._locked, work)

    async def aclose(self) -> None:
        """Close the file; later calls raise the unavailable error. Idempotent."""
        if self._closed:
            return
        # On the file's thread: after the calls already submitted.
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._close)
        self._thread.shutdown(wait=False)

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()

    def _locked(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        with self._lock:
            if self._closed:
                raise self._unavailable(f"{self._what} {self._path} is closed")
            try:
                if self._conn is None:
                    self._conn = self._connect()
                return work(self._conn)
            except (sqlite3.IntegrityError, sqlite3.ProgrammingError):
                raise  # a bug in the store, not an unavailable file
            except (sqlite3.Error, OSError) as exc:
                raise self._unavailable(f"{self._what} {self._path}: {exc!r}") from exc

    def _connect(self) -> sqlite3.Connection:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: no implicit transactions; transaction() says where they are.
        conn = sqlite3.connect(
            self._path,
            timeout=self._busy_timeout_s,
            isolation_level=None,
            check_same_thread=False,
        )
        try:
            enable_wal(conn, self._busy_timeout_s)
            # In WAL mode NORMAL loses at most the last commits on power loss, never consistency.
            conn.execute("PRAGMA synchronous = NORMAL")
            for pragma in self._pragmas:
                conn.execute(pragma)
            self._migrate(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _migrate(self, conn: sqlite3.Connection) -> None:
        latest = self.schema_version
        with transaction(conn):
            (version,) = conn.execute("PRAGMA user_version").fetchone()
            if version > latest:
                raise self._unavailable(
                    f"{self._what} {self._path} has schema version {version}, newer than this "
                    f"gateway's {latest}: upgrade the gateway or point it at another file"
                )
            for statements in self._migrations[version:]:
                for statement in statements:
                    conn.execute(statement)
            if version < latest:
                # PRAGMA takes no parameters; ``latest`` is an int, never input.
                conn.execute(f"PRAGMA user_version = {latest}")


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """A ``BEGIN IMMEDIATE`` transaction: the write lock is taken at once, so what the block
    reads cannot change before it writes. Committed if the block returns, rolled back if it
    raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # A failed COMMIT leaves the transaction open; the connection must not keep it.
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def enable_wal(connection: sqlite3.Connection, busy_timeout_s: float) -> None:
    """Put the file in WAL mode (readers never block the writer), waiting up to
    ``busy_timeout_s`` for another connection switching it at the same moment.

    Switching a new file to WAL takes an exclusive lock, and SQLite answers "database is
    locked" at once to the second of two connections doing it together: it skips its busy
    handler there, since waiting could deadlock. So the wait the busy timeout would give is
    given here. Once the file is in WAL the statement only reads the mode. Blocking: call it
    on a store's own thread, never on the event loop."""
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            connection.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(_RETRY_PAUSE_S)


def _nothing(conn: sqlite3.Connection) -> None:
    """Work that only makes ``run`` open the file."""
