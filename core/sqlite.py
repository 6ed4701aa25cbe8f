"""The one SQLite step every store that keeps a file takes on connect (tenant registry, ledger).

The only module of ``core`` that touches I/O: it runs on a connection its caller opened.
"""

from __future__ import annotations

import sqlite3
import time

_RETRY_PAUSE_S = 0.01


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
