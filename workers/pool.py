"""A pool of workers of one role: launches managed ones, health-polls all, restarts the dead.

Managed workers are vLLM servers this pool launched (``WorkerSpec``); external workers are
base URLs someone else runs (GPU hosts, another machine) and are only health-polled. The pool
owns its background tasks: one health poller, plus one supervisor per managed worker that
waits for the process to exit, reports it, and restarts it with exponential backoff.

A started pool grows and shrinks (the planner's local actuator): ``add`` launches one more
managed worker, which serves once healthy; ``drain`` takes one out of rotation, waits for what
it runs (requests, and KV decode legs have yet to read) up to a deadline, then stops it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import aiohttp

from core.messages import WorkerRole
from workers.process import WorkerProcess, WorkerSpec, tail_log
from workers.registry import Worker, least_loaded

logger = logging.getLogger("tandem.workers")

_PROGRESS_INTERVAL_S = 1.0
_READY_POLL_S = 0.1
_DRAIN_POLL_S = 0.1


class WorkerStartupError(RuntimeError):
    """A worker exited, or did not become healthy in time, while the pool waited for it."""


@dataclass(frozen=True, slots=True)
class Drained:
    """How a drained worker left."""

    name: str
    waited_s: float
    cut: int
    """Requests still in flight on it at the deadline (they end with an error event)."""
    kv_unread: int
    """Decode legs that had not read its KV at the deadline (they re-run colocated)."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: its workers and how they are watched."""

    role: WorkerRole
    """Role of every worker in the pool."""
    specs: tuple[WorkerSpec, ...] = ()
    """Workers this pool launches and supervises."""
    external_urls: tuple[str, ...] = ()
    """Base URLs of workers run elsewhere: health-polled, never launched or stopped."""
    name_prefix: str = ""
    """Put before external workers' names (``<prefix><role>-ext-<i>``): names are unique
    across every deployment of a gateway."""
    log_dir: Path = Path(".tandem/logs")
    """Where managed workers write ``<name>.log``."""
    health_interval_s: float = 1.0
    """Seconds between ``GET /health`` rounds."""
    health_timeout_s: float = 2.0
    """A health check slower than this counts as a failure."""
    unhealthy_after_failures: int = 3
    """Failed checks in a row (slow or erroring) before a worker leaves rotation; a refused
    connection counts at once. A CPU-starved vLLM server can miss one check and be fine."""
    restart_backoff_initial_s: float = 1.0
    """Delay before restarting a worker that exited; doubles with each further exit."""
    restart_backoff_max_s: float = 60.0
    """Cap on the restart delay."""
    backoff_reset_after_s: float = 60.0
    """A worker that exits this long after it first became healthy is restarted after the initial
    delay again (it had been working; the earlier crashes are history)."""
    ready_timeout_s: float = 600.0
    """Default limit for ``wait_ready`` (a cold vLLM boot on CPU takes ~1-3 min)."""
    stop_timeout_s: float = 15.0
    """Grace period between SIGTERM and SIGKILL when stopping a worker. Longer than the
    worker's own ``LaunchConfig.shutdown_timeout_s``, so vLLM's orderly shutdown can finish."""
    kv_watermark: float = 0.95
    """KV-cache usage (0..1) at which a worker counts as full (``Worker.kv_full``): ``pick()``
    passes it over while another has room, and ``DecodeCapacity`` admits nothing for it. Only
    usage someone writes on the workers counts (``KvUsageWatcher`` does, for decode pools)."""

    def __post_init__(self) -> None:
        for spec in self.specs:
            if spec.role is not self.role:
                raise ValueError(
                    f"PoolConfig.specs: {spec.name} has role {spec.role.value} in a "
                    f"{self.role.value} pool; build its spec with role={self.role.value}"
                )
        names = [spec.name for spec in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"PoolConfig.specs: worker names must be unique, got {names}")
        if self.unhealthy_after_failures < 1:
            raise ValueError(
                "PoolConfig.unhealthy_after_failures must be >= 1, "
                f"got {self.unhealthy_after_failures}"
            )
        for name in ("health_interval_s", "health_timeout_s", "restart_backoff_initial_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PoolConfig.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.kv_watermark <= 1:
            raise ValueError(f"PoolConfig.kv_watermark must be in (0, 1], got {self.kv_watermark}")


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """A snapshot of one worker for CLIs, logs and tests."""

    name: str
    base_url: str
    healthy: bool
    managed: bool
    pid: int | None
    last_exit_code: int | None
    num_restarts: int
    log_path: Path | None


@dataclass(slots=True)
class _Member:
    """Supervision state of one worker; mutated only on the pool's event loop."""

    worker: Worker
    process: WorkerProcess | None  # None: external
    backoff_s: float
    started_at: float
    # When the current process first answered /health. Kept through later health blips: a
    # crash is often preceded by a failed poll, and that must not hide a long healthy run.
    first_healthy_at: float | None = None
    num_exits: int = 0
    num_restarts: int = 0
    last_exit_code: int | None = None
    last_health_error: str = "not checked yet"
    num_health_failures: int = 0  # consecutive
    supervisor: asyncio.Task[None] | None = None
    leaving: bool = False  # a drain of it has begun
    stopping: bool = False  # its drain is stopping the process: refused checks are expected


class WorkerPool:
    """Workers of one role, their processes and health. ``start()`` then ``aclose()``."""

    role: ClassVar[WorkerRole | None] = None
    """Set by a role's own pool class; its configs must be for that role."""

    def __init__(self, config: PoolConfig) -> None:
        if self.role is not None and config.role is not self.role:
            raise ValueError(
                f"PoolConfig.role must be {self.role.value!r} for a {type(self).__name__}, "
                f"got {config.role.value!r}"
            )
        self.config = config
        now = time.monotonic()
        self._members = [
            _Member(
                Worker(spec.name, config.role, spec.base_url),
                WorkerProcess(spec, config.log_dir),
                config.restart_backoff_initial_s,
                now,
            )
            for spec in config.specs
        ] + [
            _Member(
                Worker(
                    f"{config.name_prefix}{config.role.value}-ext-{i}", config.role, url.rstrip("/")
                ),
                None,
                config.restart_backoff_initial_s,
                now,
            )
            for i, url in enumerate(config.external_urls)
        ]
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def workers(self) -> list[Worker]:
        """Every worker of the pool, managed first, in configuration order."""
        return [m.worker for m in self._members]

    @property
    def kv_watermark(self) -> float:
        """KV-cache usage at which a worker counts as full (``PoolConfig.kv_watermark``)."""
        return self.config.kv_watermark

    def pick(self) -> Worker | None:
        """The healthy worker with the fewest outstanding requests among those under the KV
        watermark; if every healthy one is over it, the least-loaded of them anyway (see
        ``least_loaded``); None if none is healthy."""
        return least_loaded(self.workers, self.config.kv_watermark)

    def process(self, name: str) -> WorkerProcess | None:
        """The process behind managed worker ``name``; None for external or unknown names."""
        return next((m.process for m in self._members if m.worker.name == name), None)

    def status(self) -> list[WorkerStatus]:
        """A snapshot of every worker."""
        return [
            WorkerStatus(
                name=m.worker.name,
                base_url=m.worker.base_url,
                healthy=m.worker.healthy,
                managed=m.process is not None,
                pid=m.process.pid if m.process else None,
                last_exit_code=m.last_exit_code,
                num_restarts=m.num_restarts,
                log_path=m.process.log_path if m.process else None,
            )
            for m in self._members
        ]

    async def start(self) -> None:
        """Launch the managed workers and begin health polling and supervision."""
        if self._session is not None:
            raise RuntimeError("pool already started")
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)
        )
        try:
            for m in self._members:
                if m.process is not None:
                    m.started_at = time.monotonic()
                    await m.process.start()
        except BaseException:
            await self.aclose()  # don't leave the workers launched so far running
            raise
        self._spawn(self._poll_health(), "health")
        for m in self._members:
            if m.process is not None:
                m.supervisor = self._spawn(
                    self._supervise(m, m.process), f"supervise {m.worker.name}"
                )

    async def add(self, spec: WorkerSpec) -> Worker:
        """Launch one more managed worker; it returns once the process started, and the worker
        takes requests once its health check passes (a vLLM boot: minutes on CPU)."""
        if self._session is None:
            raise RuntimeError("start() the pool before adding workers")
        if spec.role is not self.config.role:
            raise ValueError(f"{spec.name} is a {spec.role.value} worker, not {self.config.role}")
        if any(m.worker.name == spec.name for m in self._members):
            raise ValueError(f"the pool already has a worker named {spec.name}")
        process = WorkerProcess(spec, self.config.log_dir)
        m = _Member(
            Worker(spec.name, self.config.role, spec.base_url),
            process,
            self.config.restart_backoff_initial_s,
            time.monotonic(),
        )
        self._members.append(m)  # before the await: a concurrent add sees the name taken
        try:
            await process.start()
        except BaseException:
            self._members.remove(m)
            raise
        m.supervisor = self._spawn(self._supervise(m, process), f"supervise {spec.name}")
        logger.info("%s started (%s)", spec.name, spec.base_url)
        return m.worker

    async def drain(self, name: str, timeout_s: float) -> Drained:
        """Take managed worker ``name`` out of rotation, wait up to ``timeout_s`` for what it
        runs to end, then stop its process and remove it from the pool.

        Its streams finish on it; one still running at the deadline is cut when the process
        stops, and its client gets an error event. A decode leg still to read the KV it holds
        re-runs colocated (``Router.decode``). Cancelled, the worker stays, draining, until
        ``aclose``."""
        m = next((m for m in self._members if m.worker.name == name), None)
        if m is None or m.process is None:
            raise ValueError(f"{name} is not a managed worker of this pool")
        if m.leaving:
            raise ValueError(f"{name} is being drained already")
        m.leaving = True
        worker = m.worker
        worker.draining = True
        started = time.monotonic()
        # Polled: a worker's counts have no event to wait on, and a drain is rare.
        while worker.busy and time.monotonic() - started < timeout_s:  # noqa: ASYNC110
            await asyncio.sleep(_DRAIN_POLL_S)
        drained = Drained(
            name, time.monotonic() - started, worker.num_outstanding, worker.num_kv_held
        )
        m.stopping = True
        worker.healthy = False
        if m.supervisor is not None:  # gone first, or it would restart the stopped process
            m.supervisor.cancel()
            await asyncio.gather(m.supervisor, return_exceptions=True)
        await m.process.aclose(self.config.stop_timeout_s)
        self._members.remove(m)
        if drained.cut or drained.kv_unread:
            logger.warning(
                "%s stopped after its %.0f s drain deadline with %d requests in flight and %d "
                "KV reads pending", name, timeout_s, drained.cut, drained.kv_unread,
            )  # fmt: skip
        else:
            logger.info("%s drained in %.1f s and stopped", name, drained.waited_s)
        return drained

    async def wait_ready(
        self, timeout_s: float | None = None, on_progress: Callable[[str], None] | None = None
    ) -> None:
        """Return once every worker is healthy; ``on_progress`` gets a status line ~every second.

        Raises ``WorkerStartupError`` naming the worker, its exit code and log (with its last
        lines) if a managed worker exits meanwhile, or the workers still unhealthy at timeout.
        """
        if self._session is None:
            raise RuntimeError("call start() before wait_ready()")
        limit_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        next_progress = started
        exits_before = {m.worker.name: m.num_exits for m in self._members}
        while True:
            for m in self._members:
                if m.process is not None and (
                    m.num_exits > exits_before.get(m.worker.name, 0) or not m.process.running
                ):
                    code = m.process.returncode
                    exit_text = _describe_exit(m.last_exit_code if code is None else code)
                    raise WorkerStartupError(
                        await self._describe_failure(m, f"exited during startup ({exit_text})")
                    )
            now = time.monotonic()
            done = all(m.worker.healthy for m in self._members)
            if on_progress is not None and (done or now >= next_progress):
                on_progress(self._progress_line(now))
                next_progress = now + _PROGRESS_INTERVAL_S
            if done:
                return
            if now - started >= limit_s:
                reasons = [
                    await self._describe_failure(
                        m, f"not healthy after {limit_s:g} s (last check: {m.last_health_error})"
                    )
                    for m in self._members
                    if not m.worker.healthy
                ]
                raise WorkerStartupError("\n\n".join(reasons))
            await asyncio.sleep(_READY_POLL_S)

    async def aclose(self) -> None:
        """Stop polling and supervision, then stop every managed worker (concurrently)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        # Supervisors must be gone before processes stop, or they would restart them.
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(
            *(m.process.aclose(self.config.stop_timeout_s) for m in self._members if m.process)
        )
        for m in self._members:
            m.worker.healthy = False
        if self._session is not None:
            await self._session.close()

    def _spawn(self, coro: Coroutine[object, object, None], what: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"{self.config.role.value} pool: {what}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # These loops never end on their own; one that did is a bug to surface loudly.
            logger.error("%s crashed", task.get_name(), exc_info=exc)

    async def _poll_health(self) -> None:
        while True:
            await asyncio.gather(*(self._check_health(m) for m in self._members))
            await asyncio.sleep(self.config.health_interval_s)

    async def _check_health(self, m: _Member) -> None:
        if m.stopping or (m.process is not None and not m.process.running):
            return  # its drain or its supervisor already marked it unhealthy
        assert self._session is not None  # set in start(), before this task exists
        refused = False
        try:
            async with self._session.get(f"{m.worker.base_url}/health") as resp:
                error = None if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            refused = isinstance(exc, aiohttp.ClientConnectorError)
        if m.stopping or (m.process is not None and not m.process.running):
            return  # it was stopped or died while we asked; a late 200 must not revive it
        self._set_health(m, error, definitive=refused)

    def _set_health(self, m: _Member, error: str | None, *, definitive: bool = False) -> None:
        worker = m.worker
        m.last_health_error = error or ""
        if error is None:
            m.num_health_failures = 0
            if not worker.healthy:
                if m.first_healthy_at is None:
                    m.first_healthy_at = time.monotonic()
                logger.info("%s is healthy (%s)", worker.name, worker.base_url)
            worker.healthy = True
            return
        m.num_health_failures += 1
        failing = definitive or m.num_health_failures >= self.config.unhealthy_after_failures
        if worker.healthy and failing:
            logger.warning(
                "%s is unhealthy: %s (%d failed checks in a row)",
                worker.name, error, m.num_health_failures,
            )  # fmt: skip
            worker.healthy = False

    async def _supervise(self, m: _Member, process: WorkerProcess) -> None:
        cfg = self.config
        while True:
            code = await process.wait()
            m.worker.healthy = False
            now = time.monotonic()
            first_healthy_at = m.first_healthy_at
            if first_healthy_at is not None and now - first_healthy_at >= cfg.backoff_reset_after_s:
                m.backoff_s = cfg.restart_backoff_initial_s
            m.first_healthy_at = None
            m.num_exits += 1
            m.last_exit_code = code
            delay = self._next_delay(m)
            logger.error(
                "%s (pid %s) exited with %s; restarting in %.1f s; log: %s",
                m.worker.name, process.pid, _describe_exit(code), delay, process.log_path,
            )  # fmt: skip
            # Sweep what it left in its process group (engine core) before reusing its ports.
            await process.aclose(cfg.stop_timeout_s)
            await asyncio.sleep(delay)
            while True:
                try:
                    m.started_at = time.monotonic()
                    await process.start()
                    break
                except OSError as exc:
                    delay = self._next_delay(m)
                    logger.error(
                        "cannot restart %s: %s; retrying in %.1f s", m.worker.name, exc, delay
                    )
                    await asyncio.sleep(delay)
            m.num_restarts += 1

    def _next_delay(self, m: _Member) -> float:
        delay = m.backoff_s
        m.backoff_s = min(delay * 2, self.config.restart_backoff_max_s)
        return delay

    def _progress_line(self, now: float) -> str:
        parts = []
        for m in self._members:
            if m.worker.healthy:
                state = "healthy"
            elif m.process is None:
                state = f"waiting for {m.worker.base_url} ({m.last_health_error})"
            else:
                state = f"starting ({now - m.started_at:.0f} s)"
            parts.append(f"{m.worker.name}: {state}")
        return " | ".join(parts)

    async def _describe_failure(self, m: _Member, what: str) -> str:
        if m.process is None:
            return f"{m.worker.name} ({m.worker.base_url}) {what}"
        tail = await asyncio.to_thread(tail_log, m.process.log_path)
        return (
            f"{m.worker.name} {what}; log: {m.process.log_path}\n"
            f"--- last lines of {m.process.log_path.name} ---\n{tail}"
        )


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
