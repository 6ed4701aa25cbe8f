"""The process lifecycle the real test servers share (``redis_server.py``,
``prometheus_server.py``): launch and wait until it answers, stop (terminate, then kill),
pause and resume (SIGSTOP/SIGCONT: a server that accepts connections but never answers)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class ServerProcess:
    """One server process, started and stopped as often as its owner asks."""

    def __init__(self, name: str, start_timeout_s: float, stop_timeout_s: float) -> None:
        self._name = name
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    def launch(
        self,
        argv: Sequence[str],
        log: Path,
        ready: Callable[[], bool],
        *,
        output_to_log: bool = True,
        poll_s: float = 0.05,
    ) -> None:
        """Start ``argv`` and return once ``ready()``; ``RuntimeError`` with ``log``'s text when
        it exits or does not get ready in time. ``output_to_log``: its stdout and stderr go
        to ``log`` (False: the server writes ``log`` itself)."""
        if self._process is not None:
            raise RuntimeError(f"{self._name} already running")
        with log.open("ab") as out:
            self._process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out if output_to_log else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + self._start_timeout_s
        while not ready():
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                output = log.read_text() if log.exists() else "(no log)"
                raise RuntimeError(f"{self._name} did not start:\n{output}")
            time.sleep(poll_s)

    def stop(self) -> None:
        """Terminate the server, then kill it if it does not stop in time."""
        process, self._process = self._process, None
        if process is None:
            return
        process.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
        process.terminate()
        try:
            process.wait(self._stop_timeout_s)
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
            raise RuntimeError(f"{self._name} is not running")
        self._process.send_signal(signum)


def free_port() -> int:
    """A port of 127.0.0.1 nothing listens on (now)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
