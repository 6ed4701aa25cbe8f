"""A real ``redis-server`` for tests, on a free port of 127.0.0.1, without persistence.

``stop()`` and ``start()`` (same port) simulate an outage and a recovery; ``pause()`` and
``resume()`` (SIGSTOP/SIGCONT) a server that accepts connections but never answers.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from admission.tenants import hash_key
from tests.server_process import ServerProcess, free_port_block

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


class RedisServer(ServerProcess):
    """One ``redis-server`` process; ``start()``/``stop()`` may be repeated on the same port."""

    def __init__(self, executable: str, port: int, workdir: Path) -> None:
        super().__init__(f"redis-server on port {port}", START_TIMEOUT_S, STOP_TIMEOUT_S)
        self._executable = executable
        self.port = port
        self._workdir = workdir

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Launch the server and return once it answers PING (its data is gone on ``stop()``:
        no persistence)."""
        log = self._workdir / "redis.log"
        self.launch(
            [
                self._executable,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self._workdir),
                "--logfile", str(log),
            ],
            log,
            lambda: _answers_ping(self.port),
            output_to_log=False,
            poll_s=0.02,
        )  # fmt: skip


@contextmanager
def running_redis() -> Iterator[RedisServer]:
    """A started server on a free port below the ephemeral range (``free_port_block``: outage
    tests restart it on the same port), stopped and cleaned up on exit.

    Fails the test (never skips it) when ``redis-server`` is not installed.
    """
    executable = shutil.which("redis-server")
    if executable is None:
        pytest.fail(
            "redis-server is not on PATH; install it (apt-get install redis-server, as .ci/run "
            "does): the Redis tests run against a real server and are never skipped",
            pytrace=False,
        )
    with tempfile.TemporaryDirectory(prefix="tandem-redis-") as workdir:
        server = RedisServer(executable, free_port_block(1), Path(workdir))  # outages restart it
        server.start()
        try:
            yield server
        finally:
            server.stop()


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class Lookups:
    """Every command the Redis server runs (scripts' own calls included), from ``MONITOR``."""

    def __init__(self, url: str) -> None:
        self._redis = Redis.from_url(url)
        self.commands: list[str] = []
        self._marker = uuid.uuid4().hex
        self._marked = asyncio.Event()

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[Lookups]:
        async with self._redis.monitor() as monitor:
            reader = asyncio.create_task(self._read(monitor))
            try:
                yield self
                # A marker through another connection: once it shows, so has all before it.
                await self._redis.echo(self._marker)
                await asyncio.wait_for(self._marked.wait(), timeout=10)
            finally:
                reader.cancel()
        await self._redis.aclose()

    async def _read(self, monitor: Any) -> None:
        async for info in monitor.listen():
            self.commands.append(str(info["command"]))
            if self._marker in self.commands[-1]:
                self._marked.set()

    def of(self, key: str) -> int:
        """How many commands named ``key``'s hash (its lookups, and each script's own reads)."""
        digest = hash_key(key)
        return sum(digest in command for command in self.commands)

    def lookups_of(self, key: str) -> int:
        """How many registry lookups of ``key`` ran: scripts called with its hash (a script's
        own reads of it are not counted again)."""
        digest = hash_key(key)
        return sum(
            digest in command and command.upper().startswith(("EVALSHA", "EVAL"))
            for command in self.commands
        )
