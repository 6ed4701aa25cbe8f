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

from gateway.assembly.supervisor import port_is_free


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
    """A port of 127.0.0.1 nothing listens on (now), from the kernel's ephemeral range: for a
    server that is started once. One a test restarts takes ``free_port_block``'s."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


RESTARTABLE_PORTS = range(18000, 30000, 37)
"""Where ``free_port_block`` looks: below the kernel's ephemeral range (32768-60999 by default,
``net.ipv4.ip_local_port_range``), whose ports are also handed to outbound connections."""


_handed_out: set[int] = set()
"""Bases this process was given: a block chosen but not bound yet (the soak picks its stack's
ports, then starts PostgreSQL, then the stack) is never handed out twice."""


def free_port_block(size: int) -> int:
    """A base port of 127.0.0.1 with ``size`` (at most 37) consecutive ports free after it,
    outside the ephemeral range: a server on one can be killed and restarted on the same port.
    An ephemeral port can meanwhile become the local end of an outbound connection (a client's,
    a health check's), which a keep-alive holds, so the restarted server never binds it again."""
    if size > RESTARTABLE_PORTS.step:
        raise ValueError(f"a block is at most {RESTARTABLE_PORTS.step} ports, not {size}")
    for _ in range(2):
        for base in RESTARTABLE_PORTS:
            if base in _handed_out:
                continue
            if all(port_is_free("127.0.0.1", base + i) for i in range(size)):
                _handed_out.add(base)
                return base
        # Every base was handed out once: the servers of those still running hold their ports
        # (the bind check skips them), the others are gone.
        _handed_out.clear()
    raise RuntimeError(f"no {size} consecutive free ports in {RESTARTABLE_PORTS}")
