"""A real ``redis-server`` for tests, on a free port of 127.0.0.1, without persistence.

``stop()`` and ``start()`` (same port) simulate an outage and a recovery; ``pause()`` and
``resume()`` (SIGSTOP/SIGCONT) a server that accepts connections but never answers.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


class RedisServer:
    """One ``redis-server`` process; ``start()``/``stop()`` may be repeated on the same port."""

    def __init__(self, executable: str, port: int, workdir: Path) -> None:
        self._executable = executable
        self.port = port
        self._workdir = workdir
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Launch the server and return once it answers PING."""
        if self._process is not None:
            raise RuntimeError("redis-server already running")
        log = self._workdir / "redis.log"
        self._process = subprocess.Popen(
            [
                self._executable,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self._workdir),
                "--logfile", str(log),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers_ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                output = log.read_text() if log.exists() else "(no log)"
                raise RuntimeError(f"redis-server did not start on port {self.port}:\n{output}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Terminate the server (its data is gone: no persistence)."""
        process, self._process = self._process, None
        if process is None:
            return
        process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def pause(self) -> None:
        """Freeze the server: connections are accepted by the kernel but nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause()``."""
        self._signal(signal.SIGCONT)

    def _signal(self, signum: signal.Signals) -> None:
        if self._process is None:
            raise RuntimeError("redis-server is not running")
        self._process.send_signal(signum)


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
        server = RedisServer(executable, _free_port(), Path(workdir))
        server.start()
        try:
            yield server
        finally:
            server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False
