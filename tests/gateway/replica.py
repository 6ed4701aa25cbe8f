"""Real processes for multi-replica tests: ``tandem up`` gateways and fake decode engines.

Each runs as its own OS process, as in production: the gateways share nothing but Redis, and
the load generator, the engines and the gateways get their own interpreters (and GILs).
Teardown is SIGINT (the gateway drains and exits), then SIGKILL after a grace period, so a
failing test leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import redis

from tests.fakes.model_folder import fake_model_folder
from tests.server_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
"""Generous: on a busy machine (vLLM workers of another suite on the same cores) importing the
gateway alone can take tens of seconds."""
STOP_GRACE_S = 10.0
_LOG_TAIL_CHARS = 4000


@dataclass(frozen=True, slots=True)
class Process:
    """A started child process, its address and where its output goes."""

    name: str
    popen: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log_tail(self) -> str:
        """The end of the process's output, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


@contextmanager
def fake_engine_process(
    log_dir: Path, *, name: str, served_model_name: str, output_tokens: int
) -> Iterator[Process]:
    """``python -m tests.fakes.fake_engine`` as a decode engine on a free port."""
    port = free_port()
    argv = [
        sys.executable, "-m", "tests.fakes.fake_engine",
        "--role", "decode",
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--output-tokens", str(output_tokens),
    ]  # fmt: skip
    with _child(name, argv, os.environ.copy(), log_dir) as popen:
        process = Process(name, popen, f"http://127.0.0.1:{port}", log_dir / f"{name}.log")
        _wait_http_ok(process, "/health")
        yield process


@contextmanager
def gateway_process(
    log_dir: Path,
    *,
    name: str,
    decode_urls: list[str],
    served_model_name: str,
    env: dict[str, str],
    gateway_workers: int | None = 1,
    cores: set[int] | None = None,
) -> Iterator[Process]:
    """``tandem up`` over external decode engines only (no managed workers, no prefill pool),
    with the ``TANDEM_*`` settings in ``env``, as ``gateway_workers`` processes on its port (one
    unless asked: a test of replicas starts each as its own ``tandem up``). Yields at once, so
    several gateways boot in parallel: ``wait_ready`` each before use. ``gateway_workers``
    None: ``tandem up``'s default; ``cores``: the only cores it may run on (as ``taskset``)."""
    executable = Path(sys.executable).with_name("tandem")
    if not executable.exists():
        raise RuntimeError(f"{executable} is missing: install the project (scripts/install)")
    port = free_port()
    argv = [
        str(executable), "up",
        "--prefill-workers", "0",
        "--decode-workers", "0",
        "--served-model-name", served_model_name,
        "--port", str(port),
    ]  # fmt: skip
    if gateway_workers is not None:
        argv += ["--gateway-workers", str(gateway_workers)]
    for url in decode_urls:
        argv += ["--decode-url", url]
    # Settings come from the environment: start from a clean slate so an operator's own
    # TANDEM_* variables cannot leak into the test's gateways.
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
    child_env |= {"TANDEM_LOG_DIR": str(log_dir), **env}
    with _child(name, argv, child_env, log_dir, cores) as popen:
        yield Process(name, popen, f"http://127.0.0.1:{port}", log_dir / f"{name}.log")


@contextmanager
def _child(
    name: str, argv: list[str], env: dict[str, str], log_dir: Path, cores: set[int] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    # Output goes to a file, not a pipe: nobody reads a pipe while the test runs, and a full
    # pipe would block the child's logging (uvicorn logs every request).
    with (log_dir / f"{name}.log").open("wb") as log:
        popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            preexec_fn=None if cores is None else lambda: os.sched_setaffinity(0, cores),
        )
    try:
        yield popen
    finally:
        stop(popen)


def stop(popen: subprocess.Popen[bytes]) -> None:
    """SIGINT (graceful: drain and exit), then SIGKILL if it is still there after the grace."""
    if popen.poll() is not None:
        return
    popen.send_signal(signal.SIGINT)
    try:
        popen.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()


def wait_ready(process: Process) -> None:
    """Return once the gateway's ``/ready`` answers 200 (a healthy decode worker is known)."""
    _wait_http_ok(process, "/ready")


def _wait_http_ok(process: Process, path: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.popen.poll() is not None:
            raise RuntimeError(
                f"{process.name} exited with {process.popen.returncode} while starting:\n"
                + process.log_tail()
            )
        try:
            if httpx.get(process.base_url + path, timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{process.name} did not answer {path} within {START_TIMEOUT_S:.0f} s:\n"
                + process.log_tail()
            )
        time.sleep(0.05)


def process_urls(process: Process, state_dir: Path, count: int) -> list[str]:
    """Each gateway process's own address (``tandem up --gateway-workers``), by index, once
    ``tandem up`` has listed ``count`` of them as started (``state_dir/gateway-processes.json``)."""
    path = state_dir / "gateway-processes.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not path.exists():
        if process.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"{process.name} listed no gateway processes:\n" + process.log_tail()
            )
        time.sleep(0.05)
    rows = json.loads(path.read_text())["processes"]
    assert len(rows) == count, rows
    return [str(row["url"]) for row in sorted(rows, key=lambda row: row["index"])]


ADMIN_KEY = "replicas-admin-key"


def admin_client(replica: Process) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=replica.base_url,
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10.0,
    )


async def create_tenant(admin: httpx.AsyncClient, name: str, **plan: object) -> tuple[str, str]:
    """Create a tenant and issue a key; return (key id, key)."""
    created = await admin.post("/admin/v1/tenants", json={"name": name, **plan})
    assert created.status_code == 201, created.text
    issued = await admin.post(f"/admin/v1/tenants/{name}/keys", json={})
    assert issued.status_code == 201, issued.text
    return str(issued.json()["key_id"]), str(issued.json()["key"])


async def seconds_until(condition: Callable[[], Awaitable[bool]], timeout_s: float) -> float:
    """Poll ``condition()`` every 20 ms; return how long it took to become true."""
    start = time.monotonic()
    while not await condition():
        elapsed = time.monotonic() - start
        if elapsed > timeout_s:
            raise AssertionError(f"condition still false after {elapsed:.2f} s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


ENGINE_MODEL = "fake-model"
"""What the fake engines of ``two_gateways`` serve (each gateway also serves it itself:
``tandem up`` needs one deployment to be ready)."""


@dataclass(frozen=True, slots=True)
class Replicas:
    """Two gateway processes on one Redis database, over two fake decode engines, with two
    model folders differing only in their weights: two versions of one alias."""

    gateways: tuple[Process, Process]
    engines: tuple[Process, Process]
    folders: tuple[Path, Path]
    redis_url: str

    @property
    def a(self) -> Process:
        return self.gateways[0]

    @property
    def b(self) -> Process:
        return self.gateways[1]


@contextmanager
def two_gateways(
    redis_url: str, db: int, name: str, env: dict[str, str] | None = None
) -> Iterator[Replicas]:
    """``Replicas`` on database ``db`` of ``redis_url``'s server (flushed first), with ``env``
    added to each gateway's environment; torn down, and their folder removed, even on failure."""
    own_url = f"{redis_url.rsplit('/', 1)[0]}/{db}"
    with redis.Redis.from_url(own_url) as raw:
        raw.flushdb()
    log_dir = Path(tempfile.mkdtemp(prefix=f"tandem-{name}-"))
    folders = (
        fake_model_folder(log_dir / "tiny-1", weights=b"weights of version one"),
        fake_model_folder(log_dir / "tiny-2", weights=b"weights of version two"),
    )
    try:
        with (
            fake_engine_process(
                log_dir, name="engine-1", served_model_name=ENGINE_MODEL, output_tokens=3
            ) as engine_1,
            fake_engine_process(
                log_dir, name="engine-2", served_model_name=ENGINE_MODEL, output_tokens=3
            ) as engine_2,
        ):
            shared = {
                "TANDEM_REDIS_URL": own_url,
                "TANDEM_ADMIN_KEY": ADMIN_KEY,
                "TANDEM_CACHE_DIR": str(log_dir / "cache"),
                **(env or {}),
            }
            gateways = [
                gateway_process(
                    log_dir,
                    name=gateway,
                    decode_urls=[engine_1.base_url, engine_2.base_url],
                    served_model_name=ENGINE_MODEL,
                    env={**shared, "TANDEM_STATE_DIR": str(log_dir / f"state-{gateway}")},
                )
                for gateway in ("gateway-a", "gateway-b")
            ]
            with gateways[0] as a, gateways[1] as b:
                wait_ready(a)
                wait_ready(b)
                yield Replicas((a, b), (engine_1, engine_2), folders, own_url)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
