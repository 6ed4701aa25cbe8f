"""Getting usage records into the ledger database off the request path, losing none.

    submit(record)      on the event loop: one append to the current spool segment (a local
                        file, no fsync) and a place in memory; returns at once
    flusher (task)      every ``flush_interval_s`` (or when a batch fills): seal the segment,
                        insert its records in one transaction, delete the file
    database down       the sealed segments stay on disk; retried with backoff, oldest first
    gateway restarts    segments left by the previous process are replayed at start

The segment files are the spool and the journal at once: a record is on disk before anything
else happens to it, and its file goes only after the database committed it. Replays cannot
double anything: the ledger ignores a ``record_id`` it has (``ON CONFLICT DO NOTHING``). What
can still be lost is what the OS had not written back when the machine itself lost power.

Every database call runs on one dedicated thread, in order: a budget refresh queued after an
insert sees it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson

from billing.records import UsageRecord
from billing.store import LedgerStore, LedgerUnavailableError, RequestLogEntry

log = logging.getLogger("tandem.billing")

T = TypeVar("T")

_SUFFIX = ".jsonl"


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """How records travel from the gateway to the ledger database."""

    spool_dir: Path
    """Where segment files live until the database has their records (one gateway per dir)."""
    flush_interval_s: float = 0.2
    """Longest time a record waits in memory before its batch is written."""
    max_batch: int = 1000
    """A batch this large is written at once, without waiting for the interval."""
    retry_initial_s: float = 0.5
    """First wait after the database failed; doubles up to ``retry_max_s``."""
    retry_max_s: float = 15.0
    """Longest wait between two attempts while the database is down."""


@dataclass(slots=True)
class WriterStats:
    """Counters the gateway exposes on ``/metrics``."""

    num_submitted: int = 0
    num_written: int = 0
    num_duplicates: int = 0
    """Records the ledger had already (replays after a crash between commit and delete)."""
    num_replayed: int = 0
    """Records inserted from segments a previous process left behind."""
    num_write_failures: int = 0
    num_spool_errors: int = 0
    """Appends to the spool file that failed (the record then lives in memory only)."""
    num_corrupt_lines: int = 0
    database_up: bool = True


@dataclass(slots=True)
class _Segment:
    path: Path
    fd: int | None = None
    usage: list[UsageRecord] | None = field(default_factory=list)
    """In memory while this process wrote it and the database has not failed on it;
    None: read it back from the file."""
    logs: list[RequestLogEntry] | None = field(default_factory=list)
    num_lines: int = 0
    recovered: bool = False
    on_disk: bool = True
    """Every line reached the file; False after a spool error: the lists are then the only
    copy and must not be dropped."""
    read_once: bool = False
    """Its file was read back already (corrupt lines are counted on the first read only)."""


class LedgerWriter:
    """Owns the flusher task, the spool segments and the database thread."""

    def __init__(self, store: LedgerStore, config: WriterConfig) -> None:
        self._store = store
        self._config = config
        self.stats = WriterStats()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ledger")
        self._current: _Segment | None = None
        self._sealed: collections.deque[_Segment] = collections.deque()
        self._sequence = 0
        self._wake = asyncio.Event()
        self._draining = asyncio.Lock()  # one drain at a time: segments leave in order, once
        self._task: asyncio.Task[None] | None = None
        self._retry_s = config.retry_initial_s
        self._migrated = False

    async def start(self) -> None:
        """Migrate the schema if the database is up, queue any segments a previous process left,
        and start flushing. A database that is down now is retried later, like any outage."""
        self._config.spool_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self._config.spool_dir.glob(f"*{_SUFFIX}")):
            num_lines = await asyncio.to_thread(_count_lines, path)
            self._sealed.append(
                _Segment(path, usage=None, logs=None, num_lines=num_lines, recovered=True)
            )
        if self._sealed:
            log.info("ledger: replaying %d spool segment(s) from %s", len(self._sealed),
                     self._config.spool_dir)  # fmt: skip
        try:
            await self._migrate()
        except LedgerUnavailableError as exc:
            self.stats.database_up = False
            log.error("ledger database unavailable at start (records spool until it is up): %s",
                      exc)  # fmt: skip
        self._task = asyncio.create_task(self._run(), name="ledger-writer")

    async def run(self, call: Callable[..., T], *args: Any) -> T:
        """Run a store call on the database thread (every database call goes through here)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, call, *args)

    def submit(self, record: UsageRecord, log_entry: RequestLogEntry | None = None) -> None:
        """Take a record (and its request-log entry, for tenants that keep one); never blocks
        on the database and never raises."""
        segment = self._segment()
        line: dict[str, Any] = {"usage": record.to_dict()}
        if log_entry is not None:
            line["log"] = _log_to_dict(log_entry)
        self._append(segment, orjson.dumps(line) + b"\n")
        if segment.usage is not None and segment.logs is not None:  # always, for a current one
            segment.usage.append(record)
            if log_entry is not None:
                segment.logs.append(log_entry)
        self.stats.num_submitted += 1
        if segment.num_lines >= self._config.max_batch and self.stats.database_up:
            self._wake.set()

    @property
    def num_pending(self) -> int:
        """Records not yet known to be in the database (in memory or spooled)."""
        current = self._current.num_lines if self._current else 0
        return current + sum(segment.num_lines for segment in self._sealed)

    async def flush(self) -> bool:
        """Write everything submitted before this call; False if the database is down (it is
        kept on disk). The segment is sealed before the first await: a record submitted after
        the call starts is not part of it."""
        self._seal()
        return await self._drain()

    async def aclose(self) -> None:
        """Stop the flusher, try once more to write everything, and release the thread. What the
        database does not take stays in the spool for the next start."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()  # seals (closing the open segment's file); False leaves it spooled
        await self.run(self._store.close)
        self._executor.shutdown(wait=True)

    # -- the flusher -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on 3.11 wait_for returns a wait that finished in
            # the same loop iteration as a cancel, and aclose() would then wait forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._wait_s()):
                    await self._wake.wait()
            self._wake.clear()
            self._seal()
            await self._drain()

    def _wait_s(self) -> float:
        return self._config.flush_interval_s if self.stats.database_up else self._retry_s

    async def _drain(self) -> bool:
        async with self._draining:
            return await self._drain_locked()

    async def _drain_locked(self) -> bool:
        try:
            if not self._migrated:
                # The database was down at start: its schema may not exist yet, and inserts
                # (and the reads that flush first) need it.
                await self._migrate()
                self._on_success()
            while self._sealed:
                await self._write(self._sealed[0])
                self._sealed.popleft()
                self._on_success()
        except LedgerUnavailableError as exc:
            self._on_failure(exc)
            return False
        return True

    async def _migrate(self) -> None:
        """Bring the schema up to date, once per process: at start, or at the first drain
        that reaches the database if it was down then."""
        applied = await self.run(self._store.migrate)
        self._migrated = True
        if applied:
            log.info("ledger: applied schema migrations %s", applied)

    async def _write(self, segment: _Segment) -> None:
        if segment.usage is None or segment.logs is None:
            read, read_logs, corrupt = await self.run(_read_segment, segment.path)
            segment.usage, segment.logs, segment.num_lines = read, read_logs, len(read)
            if not segment.read_once:  # a retry re-reads the same torn lines
                self.stats.num_corrupt_lines += corrupt
                segment.read_once = True
        usage: list[UsageRecord] = segment.usage or []
        logs: list[RequestLogEntry] = segment.logs or []
        for start in range(0, len(usage), self._config.max_batch):
            batch = usage[start : start + self._config.max_batch]
            result = await self.run(self._store.insert_usage, batch)
            self.stats.num_written += result.num_inserted
            self.stats.num_duplicates += result.num_duplicates
            if segment.recovered:
                self.stats.num_replayed += result.num_inserted
        if logs:
            await self.run(self._store.insert_request_log, logs)
        await self.run(_unlink, segment.path)

    def _on_success(self) -> None:
        if not self.stats.database_up:
            log.info("ledger database is back: writing spooled records")
        self.stats.database_up = True
        self._retry_s = self._config.retry_initial_s

    def _on_failure(self, exc: LedgerUnavailableError) -> None:
        self.stats.num_write_failures += 1
        if self.stats.database_up:
            log.error("ledger database unavailable; spooling records in %s: %s",
                      self._config.spool_dir, exc)  # fmt: skip
        self.stats.database_up = False
        # Their records are on disk: memory stays flat however long the outage lasts.
        for sealed in self._sealed:
            _drop_lists(sealed)
        self._retry_s = min(self._retry_s * 2, self._config.retry_max_s)

    # -- segments --------------------------------------------------------------------------

    def _segment(self) -> _Segment:
        if self._current is None:
            self._sequence += 1
            name = f"{time.time_ns():020d}-{os.getpid()}-{self._sequence:06d}{_SUFFIX}"
            path = self._config.spool_dir / name
            segment = _Segment(path)
            try:
                segment.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError as exc:
                self.stats.num_spool_errors += 1
                segment.on_disk = False
                log.error("ledger spool %s cannot be opened (records kept in memory): %s",
                          path, exc)  # fmt: skip
            self._current = segment
        return self._current

    def _append(self, segment: _Segment, line: bytes) -> None:
        segment.num_lines += 1
        if segment.fd is None:
            return
        try:
            os.write(segment.fd, line)  # O_APPEND: one write per line, never interleaved
        except OSError as exc:
            self.stats.num_spool_errors += 1
            segment.on_disk = False
            log.error("ledger spool write failed (record kept in memory): %s", exc)

    def _seal(self) -> None:
        segment, self._current = self._current, None
        if segment is None:
            return
        if segment.fd is not None:
            os.close(segment.fd)
            segment.fd = None
        if segment.num_lines:
            if not self.stats.database_up:
                _drop_lists(segment)  # it waits on disk until the database is back
            self._sealed.append(segment)
        else:
            _unlink(segment.path)


def _drop_lists(segment: _Segment) -> None:
    """Keep a sealed segment on disk only (read back when it is written), unless its file
    missed a line."""
    if segment.on_disk:
        segment.usage = None
        segment.logs = None


def _log_to_dict(entry: RequestLogEntry) -> dict[str, Any]:
    return {
        "record_id": entry.record_id,
        "request_id": entry.request_id,
        "tenant_id": entry.tenant_id,
        "created_at_us": entry.created_at_us,
        "expires_at_us": entry.expires_at_us,
        "prompt": entry.prompt,
        "output": entry.output,
    }


def _read_segment(path: Path) -> tuple[list[UsageRecord], list[RequestLogEntry], int]:
    """A segment's records; a line cut short by a crash is skipped and counted."""
    usage: list[UsageRecord] = []
    logs: list[RequestLogEntry] = []
    corrupt = 0
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return usage, logs, corrupt
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            line = orjson.loads(raw)
            usage.append(UsageRecord.from_dict(line["usage"]))
            if "log" in line:
                logs.append(RequestLogEntry(**line["log"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            corrupt += 1
            log.error("ledger spool %s: skipping an unreadable line: %s", path, exc)
    return usage, logs, corrupt


def _count_lines(path: Path) -> int:
    """Records in a segment left by a previous process (for ``num_pending`` until it is read)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
