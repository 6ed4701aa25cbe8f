"""The ``redis-server`` that ``tandem up`` starts and owns when several gateway processes must
share their stores and no ``TANDEM_REDIS_URL`` names one.

It listens on a unix socket only (``--port 0``: nothing on the network can reach it), in its own
data directory under the state directory, with the append-only file on (``fsync`` every
second): tenants, keys, versions and the audit log live there while several processes run, so
they must survive a restart as the SQLite files of one process do. RDB snapshots are off (the
append-only file is the one copy; a fork of a large dataset would stall it). It starts in its
own session (a Ctrl-C on the terminal reaches ``tandem up`` alone, which stops it last) and
dies with ``tandem up`` if that is killed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from workers.process import die_with_parent

log = logging.getLogger("tandem.redis")

START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 10.0
_MAX_SOCKET_PATH = 100
"""Linux's limit on a unix socket's path is 107 bytes; past it the socket goes to /tmp."""


class RedisServerError(Exception):
    """The owned ``redis-server`` cannot run; the message says what to do."""


class OwnedRedis:
    """One ``redis-server`` process: ``start()`` returns once it answers PING, ``aclose()``
    stops it (SIGTERM: it writes its append-only file and exits; SIGKILL past the timeout)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        socket_path = data_dir.resolve() / "redis.sock"
        if len(str(socket_path)) > _MAX_SOCKET_PATH:
            socket_path = Path(tempfile.mkdtemp(prefix="tandem-redis-")) / "redis.sock"
        self.socket_path = socket_path
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (benchmarks pin it and read its CPU)."""
        return None if self._proc is None else self._proc.pid

    @property
    def url(self) -> str:
        """What ``TANDEM_REDIS_URL`` would say to reach it (database 0)."""
        return f"unix://{self.socket_path}?db=0"

    async def start(self) -> None:
        executable = shutil.which("redis-server")
        if executable is None:
            raise RedisServerError(
                "several gateway processes share their stores through Redis, and redis-server "
                "is not on PATH: install it (scripts/install does; or apt-get install "
                "redis-server), point TANDEM_REDIS_URL at a Redis, or run --gateway-workers 1"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)  # left by a killed run: redis would refuse it
        argv = [
            executable,
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir.resolve()),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--logfile", "redis.log",
            "--daemonize", "no",
        ]  # fmt: skip
        self._proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(os.getpid()),
        )
        log.info("started redis-server (pid %d) on %s", self._proc.pid, self.socket_path)
        await self._wait_for_ping()

    async def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = Redis(unix_socket_path=str(self.socket_path), socket_timeout=1.0)
        try:
            while True:
                if self._proc is not None and self._proc.returncode is not None:
                    raise RedisServerError(
                        f"redis-server exited with {self._proc.returncode} while starting: "
                        f"see {self.data_dir / 'redis.log'}"
                    )
                try:
                    if await client.ping():
                        return
                except (RedisError, OSError):
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise RedisServerError(
                        f"redis-server did not answer within {START_TIMEOUT_S:.0f} s: see "
                        f"{self.data_dir / 'redis.log'}"
                    )
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()

    async def aclose(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            log.error("redis-server (pid %d) ignored SIGTERM for %.0f s: killed", proc.pid,
                      STOP_TIMEOUT_S)  # fmt: skip
            proc.kill()
            await proc.wait()
        log.info("redis-server stopped")
