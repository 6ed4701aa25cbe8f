"""The processes of a benchmark: fake engines, Tandem's gateway, LiteLLM's proxy.

Each runs as a child process pinned to its cores (``sched_setaffinity`` before ``exec``, so
every thread and child inherits it), in its own session (so stopping it takes its children
along), with its output in a log file (a full pipe would stall it). ``Server.cpu_times`` is
what the process and its live children used so far (user, system); ``Server.rss_bytes``
the memory they hold now.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from bench.overhead.fake_vllm import Timing

READY_TIMEOUT_S = 60.0


class StartError(RuntimeError):
    """A server did not come up; the message carries the end of its log."""


@dataclass(slots=True)
class Server:
    """A running child process serving HTTP at ``url``."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    cores: frozenset[int] | None

    @property
    def pid(self) -> int:
        return self.process.pid

    def cpu_times(self) -> tuple[float, float]:
        """User and system CPU seconds of the process and its live children, so far."""
        return process_tree_cpu_times(self.pid)

    def cpu_seconds(self) -> float:
        return sum(self.cpu_times())

    def rss_bytes(self) -> int:
        """Resident memory of the process and its live children, now."""
        return process_tree_rss(self.pid)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM to its session, then SIGKILL after ``timeout_s``; idempotent."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait(5)

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"


def process_tree_cpu_times(
    pid: int, *, children: bool = True, named: str | None = None
) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` and (unless ``children`` is false) its live
    descendants (0 for gone ones); with ``named``, only the descendants whose process name
    holds it (``"redis-server"``: the Redis a ``tandem up`` started)."""
    user = system = 0.0
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True) if children or named else []
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    processes = [root, *descendants] if named is None else descendants
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if named is not None and named not in process.name():
                continue
            times = process.cpu_times()
            user, system = user + times.user, system + times.system
    return user, system


def process_tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its live descendants (0 once it is gone)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.memory_info().rss
    return total


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def usable_cores(wanted: set[int] | None) -> frozenset[int] | None:
    """``wanted`` if this machine has those cores (None: do not pin)."""
    if wanted is None:
        return None
    available = os.sched_getaffinity(0)
    return frozenset(wanted) if wanted <= available else None


def spawn(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    cores: frozenset[int] | None,
    env: dict[str, str] | None = None,
    *,
    stdout_pipe: bool = False,
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start ``argv`` pinned to ``cores``, its output in ``log_dir/<name>.log`` (stdout in a
    pipe instead with ``stdout_pipe``, for a ready line)."""
    log_path = log_dir / f"{name}.log"

    def pin() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)

    with log_path.open("wb") as log:
        process = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE if stdout_pipe else log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            preexec_fn=pin,
            start_new_session=True,
        )
    return process, log_path


def start_fake_engine(
    name: str, timing: Timing, model: str, log_dir: Path, cores: frozenset[int] | None
) -> Server:
    """``python -m bench.overhead.fake_vllm``; returns once it printed its ready line."""
    argv = [
        sys.executable, "-m", "bench.overhead.fake_vllm", "--served-model-name", model,
        "--tokens", str(timing.num_tokens), "--itl-ms", str(timing.itl_s * 1000),
        "--ttft-ms", str(timing.ttft_s * 1000), "--kv-ttft-ms", str(timing.kv_ttft_s * 1000),
    ]  # fmt: skip
    process, log_path = spawn(name, argv, log_dir, cores, stdout_pipe=True)
    server = Server(name, "", process, log_path, cores)
    line = _read_line(process, READY_TIMEOUT_S)
    if not line.startswith("FAKE_VLLM_READY "):
        server.stop()
        raise StartError(f"{name} did not start: {line!r}\n{server.log_tail()}")
    server.url = line.split(" ", 1)[1].strip()
    return server


def _read_line(process: subprocess.Popen[bytes], timeout_s: float) -> str:
    stdout = process.stdout
    if stdout is None:
        return ""
    ready, _, _ = select.select([stdout], [], [], timeout_s)
    return stdout.readline().decode(errors="replace") if ready else ""


def wait_http_ready(server: Server, path: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll ``GET url+path`` until 200; ``StartError`` if the process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise StartError(
                    f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}"
                )
            try:
                response = client.get(server.url + path)
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
    server.stop()
    raise StartError(
        f"{server.name} not ready after {timeout_s:g} s ({last}):\n{server.log_tail()}"
    )


def start_python_server(
    name: str,
    argv: Sequence[str],
    url: str,
    ready_path: str,
    log_dir: Path,
    cores: frozenset[int] | None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Server:
    """A server that says nothing useful on stdout: ready when ``ready_path`` answers 200."""
    process, log_path = spawn(name, argv, log_dir, cores, env)
    server = Server(name, url, process, log_path, cores)
    wait_http_ready(server, ready_path, ready_timeout_s)
    return server
