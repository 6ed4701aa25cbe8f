"""Several gateway processes on one port: ``tandem up --gateway-workers N``.

``tandem up`` is process 0, the primary: it owns the workers, their supervisor and the Redis it
may start, and serves like the others. It launches processes 1..N-1 (``python -m
gateway.cli.gateway_process``) once it serves, handing each on its standard input a
``Handoff`` (the settings, and every deployment's workers as external ones) and two listening
sockets it bound itself: one on ``host:port`` with ``SO_REUSEPORT`` (every process has its own
in the port's group, so the kernel spreads connections over them by hash) and one on
``127.0.0.1`` that only this process serves (its own ``/metrics``). The primary keeps its
copies of the sockets, so a restarted process gets the same ones back and connections the
kernel gave a dead process's socket wait in its backlog instead of being refused. Until the
restarted process answers, the primary accepts on that socket too (``cover``): those
connections are served at once instead of waiting out a restart (imports and the app's
start-up: 3 s on an idle machine, 20 s measured by the chaos soak under load).

A process that exits while the stack runs is logged as an error and restarted after a backoff
(1 s, doubling to 30 s; back to 1 s once it has run a minute). Stopping: SIGTERM to each (each
drains as ``tandem up`` does), SIGKILL past the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import Stack, spool_dir
from workers.process import die_with_parent

log = logging.getLogger("tandem.gateway.processes")

PROCESS_HEADER = "x-tandem-gateway-process"
"""Response header naming the gateway process that answered (with several processes)."""
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0
_BACKOFF_S = (1.0, 30.0)
_HEALTHY_RUN_S = 60.0
"""A process that ran this long before exiting restarts after the shortest backoff again."""


def default_gateway_workers(
    available_cores: Iterable[int], worker_bindings: Sequence[str], num_managed_workers: int
) -> int:
    """The cores available to ``tandem up`` minus those its managed workers are bound to (the
    first ``num_managed_workers`` entries of ``cpu_binding``: workers past its end are not
    pinned), at least 1. A binding ``vLLM`` reads as ``all`` takes every core."""
    cores = set(available_cores)
    bound: set[int] = set()
    for binding in worker_bindings[:num_managed_workers]:
        if binding.strip() == "all":
            bound |= cores
        bound |= _cores_of(binding)
    return max(1, len(cores - bound))


def _cores_of(binding: str) -> set[int]:
    """``0``, ``0-3``, ``0-3|8-11`` (vLLM's OpenMP binding); anything else binds no core."""
    cores: set[int] = set()
    for part in binding.replace("|", ",").split(","):
        low, _, high = part.strip().partition("-")
        if low.isdigit() and (not high or high.isdigit()):
            cores |= set(range(int(low), int(high or low) + 1))
    return cores


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A bound TCP socket (uvicorn or asyncio calls ``listen``), inheritable by children."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.set_inheritable(True)
    return sock


def own_socket(settings: TandemSettings, index: int) -> socket.socket:
    """Process ``index``'s socket on 127.0.0.1 alone (``gateway_process_base_port`` + index, or
    a free port)."""
    base = settings.gateway_process_base_port
    return listening_socket("127.0.0.1", base + index if base else 0, reuse_port=False)


@dataclass(frozen=True, slots=True)
class HandedDeployment:
    """One deployment as a secondary process serves it: the version (its record, ``None`` for
    an unregistered model) on the primary's workers, reached as external ones."""

    version: dict[str, Any] | None
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    served_as: str | None


@dataclass(frozen=True, slots=True)
class Handoff:
    """What a secondary process is told on its standard input (it carries secrets: never a
    file, never an argument other processes can read)."""

    index: int
    settings: dict[str, Any]
    deployments: tuple[HandedDeployment, ...]

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "index": self.index,
                "settings": self.settings,
                "deployments": [
                    {
                        "version": d.version,
                        "prefill_urls": list(d.prefill_urls),
                        "decode_urls": list(d.decode_urls),
                        "served_as": d.served_as,
                    }
                    for d in self.deployments
                ],
            },
            default=_plain,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Handoff:
        raw = json.loads(data)
        return cls(
            index=int(raw["index"]),
            settings=dict(raw["settings"]),
            deployments=tuple(
                HandedDeployment(
                    d["version"], tuple(d["prefill_urls"]), tuple(d["decode_urls"]), d["served_as"]
                )
                for d in raw["deployments"]
            ),
        )


def settings_for_handoff(settings: TandemSettings) -> dict[str, Any]:
    """Every setting, secrets included (the handoff is a pipe), as JSON-able values."""
    return json.loads(json.dumps(settings.model_dump(), default=_plain))  # type: ignore[no-any-return]


def _plain(value: object) -> object:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, Path | Decimal):
        return str(value)
    raise TypeError(f"{type(value).__name__} does not cross to a gateway process")


def process_headers(index: int) -> list[tuple[str, str]]:
    """uvicorn's default headers for gateway process ``index`` (``uvicorn.Config(headers=...)``):
    every HTTP response names the process that answered. uvicorn adds them as it starts each
    response; a middleware that did it wrapped every message of every stream."""
    return [(PROCESS_HEADER, str(index))]


@dataclass(slots=True)
class _Secondary:
    index: int
    handoff: bytes
    shared: socket.socket
    own: socket.socket
    proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.own.getsockname()[1]}"


class GatewayProcesses:
    """The primary's secondary gateway processes: launched, restarted with backoff, stopped."""

    def __init__(
        self,
        handoffs: Sequence[Handoff],
        sockets: Sequence[tuple[socket.socket, socket.socket]],
        log_level: str,
        on_relaunch: Callable[[GatewayProcesses], None] | None = None,
        cover: Cover | None = None,
    ) -> None:
        """``sockets``: each process's (shared, own) pair, closed by ``aclose``;
        ``on_relaunch`` runs after a process was restarted (its pid changed); ``cover`` serves
        a dead process's shared socket from this process until its restart answers."""
        self._log_level = log_level
        self._on_relaunch = on_relaunch
        self._cover = cover
        self._secondaries = [
            _Secondary(h.index, h.to_json(), shared, own)
            for h, (shared, own) in zip(handoffs, sockets, strict=True)
        ]
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False

    @property
    def urls(self) -> list[str]:
        """Each process's own address (127.0.0.1), by index from 1."""
        return [s.url for s in self._secondaries]

    @property
    def pids(self) -> list[int | None]:
        return [s.proc.pid if s.proc is not None else None for s in self._secondaries]

    async def start(self) -> None:
        """Launch every process and wait until each answers ``/health`` on its own address."""
        for secondary in self._secondaries:
            await self._launch(secondary)
            task = asyncio.create_task(
                self._supervise(secondary), name=f"gateway-{secondary.index}"
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.gather(*(_wait_healthy(s) for s in self._secondaries))

    async def _launch(self, secondary: _Secondary) -> None:
        shared_fd, own_fd = secondary.shared.fileno(), secondary.own.fileno()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli.gateway_process",
            "--shared-fd", str(shared_fd), "--own-fd", str(own_fd),
            "--log-level", self._log_level,
            stdin=asyncio.subprocess.PIPE,
            pass_fds=(shared_fd, own_fd),
            # Its own session: a Ctrl-C on the terminal reaches the primary alone, which stops
            # the processes itself (and notices no one died unexpectedly).
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )  # fmt: skip
        assert proc.stdin is not None  # PIPE asked for
        proc.stdin.write(secondary.handoff)
        await proc.stdin.drain()
        proc.stdin.close()
        secondary.proc = proc
        log.info("gateway process %d started (pid %d), own address %s", secondary.index,
                 proc.pid, secondary.url)  # fmt: skip

    async def _supervise(self, secondary: _Secondary) -> None:
        backoff_s = _BACKOFF_S[0]
        while True:
            assert secondary.proc is not None
            started = time.monotonic()
            code = await secondary.proc.wait()
            if self._stopping:
                return
            if time.monotonic() - started > _HEALTHY_RUN_S:
                backoff_s = _BACKOFF_S[0]
            covering = await self._cover(secondary.shared) if self._cover else None
            log.error("gateway process %d (pid %d) exited with %d: restarting it in %.0f s "
                      "(%s)", secondary.index, secondary.proc.pid, code, backoff_s,
                      "this process serves its connections meanwhile" if covering
                      else "its connections wait meanwhile")  # fmt: skip
            try:
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _BACKOFF_S[1])
                if self._stopping:
                    return
                await self._launch(secondary)
                if self._on_relaunch is not None:
                    self._on_relaunch(self)
                if covering is not None:
                    with contextlib.suppress(GatewayProcessError):  # it died again: next turn
                        await _wait_healthy(secondary)
            finally:
                if covering is not None:
                    covering.close()  # stops accepting; connections it took run to their end

    def signal_stop(self) -> None:
        """SIGTERM every process (each stops accepting and drains its streams); no restarts
        from now on. Safe to repeat."""
        self._stopping = True
        for secondary in self._secondaries:
            proc = secondary.proc
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGTERM)

    async def aclose(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every process (``signal_stop``), SIGKILL those left after ``timeout_s``, then
        close the sockets."""
        self.signal_stop()
        for task in list(self._tasks):
            task.cancel()
        running = [s.proc for s in self._secondaries if s.proc and s.proc.returncode is None]
        deadline = time.monotonic() + timeout_s
        for proc in running:
            try:
                await asyncio.wait_for(proc.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                log.error("gateway process pid %d still running %.0f s after SIGTERM: killed",
                          proc.pid, timeout_s)  # fmt: skip
                proc.kill()
                await proc.wait()
        for secondary in self._secondaries:
            secondary.shared.close()
            secondary.own.close()


async def _wait_healthy(secondary: _Secondary) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with httpx.AsyncClient(timeout=1.0) as client:
        while True:
            proc = secondary.proc
            if proc is not None and proc.returncode is not None:
                raise GatewayProcessError(
                    f"gateway process {secondary.index} exited with {proc.returncode} while "
                    "starting (its log is above)"
                )
            try:
                if (await client.get(f"{secondary.url}/health")).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # still importing
            if time.monotonic() > deadline:
                raise GatewayProcessError(
                    f"gateway process {secondary.index} did not answer {secondary.url}/health "
                    f"within {READY_TIMEOUT_S:.0f} s"
                )
            await asyncio.sleep(0.1)


Cover = Callable[[socket.socket], Awaitable[asyncio.Server]]
"""Start accepting on a listening socket (a duplicate of it: closing the returned server
leaves the socket open) with the primary's app, until the returned server is closed."""


class GatewayProcessError(Exception):
    """Several gateway processes cannot run (one did not start, or a setting needs one
    process); the message says why and what to do."""


def write_process_list(path: Path, entries: Sequence[tuple[int, int | None, str]]) -> None:
    """``state_dir/gateway-processes.json``: each process's index, pid and own address, for
    scraping each one's ``/metrics`` (a scrape of the shared port reaches one at random)."""
    rows = [{"index": i, "pid": pid, "url": url} for i, pid, url in entries]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"processes": rows}, indent=2) + "\n")
    tmp.replace(path)


def handoffs(stack: Stack, settings: TandemSettings) -> list[Handoff]:
    """What processes 1..N-1 are told: ``settings`` (the primary's, Redis included, with no
    workers or planner of their own) and every deployment's workers as external ones."""
    versions = {version.name: version for version in stack.declared.register}
    deployments = tuple(
        HandedDeployment(
            versions[d.version].to_dict() if d.version in versions else None,
            tuple(worker.base_url for worker in d.prefill.workers),
            tuple(worker.base_url for worker in d.decode.workers),
            d.model.served_as,
        )
        for d in stack.deployments
    )
    num_processes = stack.num_processes
    own = settings.model_copy(
        update={
            "gateway_workers": num_processes,
            "num_prefill_workers": 0,
            "num_decode_workers": 0,
            "prefill_urls": [],
            "decode_urls": [],
            "planner": "off",
            "config": None,
        }
    )
    plain = settings_for_handoff(own)
    return [Handoff(i, plain, deployments) for i in range(1, num_processes)]


def adopt_orphan_spools(state_dir: Path, num_processes: int) -> None:
    """Move the ledger segments of processes this run does not have (a former run had more)
    into process 0's spool, which replays them. Called before any process starts."""
    target = spool_dir(state_dir, 0)
    for path in sorted(state_dir.glob("ledger-spool-*")):
        index = path.name.removeprefix("ledger-spool-")
        if not index.isdigit() or int(index) < num_processes:
            continue
        segments = list(path.iterdir())
        if segments:
            target.mkdir(parents=True, exist_ok=True)
            log.info("ledger: adopting %d spool segment(s) of %s", len(segments), path)
        for segment in segments:
            segment.replace(target / segment.name)
