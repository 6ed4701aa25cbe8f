"""A real ``redis-server`` for tests, on a free port of 127.0.0.1, without persistence.

``stop()`` and ``start()`` (same port) simulate an outage and a recovery; ``pause()`` and
``resume()`` (SIGSTOP/SIGCONT) a server that accepts connections but never answers.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.server_process import ServerProcess, free_port

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
    """A started server on a free port, stopped and cleaned up on exit.

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
        server = RedisServer(executable, free_port(), Path(workdir))
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
