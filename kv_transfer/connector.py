"""vLLM ``--kv-transfer-config`` and the environment for each worker role, generated in one place
for CPU and GPU.

Which UCX transport moves the KV is UCX's choice, per pair of workers: it opens an endpoint with
each transport that reaches the peer and picks the fastest for each operation. With UCX's default
transport list (``all``), a decode worker's READs from a prefill worker on the same host go over
CMA (``process_vm_readv``, one kernel copy), and to one on another host over RDMA or TCP; only
small messages (handshake, notifications) go over TCP loopback. Measured in
``bench/kv_transfer/ucx_transports.py`` (issue 24): on one 2-core host, READs of a 1k-4k-token
prompt's KV ran at 2-3 GB/s with CMA when each side is pinned to one core as ``tandem up`` binds
workers, 4-5.6 GB/s unpinned, and 0.3-0.9 GB/s restricted to ``tcp``. POSIX and
SysV shared memory cannot serve NIXL: NIXL asks for peer failure handling, which they lack, and
they cannot read memory UCX did not allocate, so a list of shared-memory transports alone fails
when the backend starts. Where CMA is not permitted (Yama ``ptrace_scope`` 2 or 3, a seccomp
filter), UCX finds out when it starts and leaves it out: transfers take TCP, they do not fail.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

from core.messages import WorkerRole
from kv_transfer.nixl_progress import DELAY_ENV, NICE_ENV


class KvBufferDevice(enum.StrEnum):
    """Where NIXL stages KV blocks: host memory on CPU workers, device memory on GPUs."""

    CPU = "cpu"
    CUDA = "cuda"


_SHARED_MEMORY_ONLY = frozenset(
    {"sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem", "self"}
)

DEFAULT_KV_LEASE_S = 10
"""The KV lease workers and the gateway use unless configured (vLLM's own is 30 s)."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """How workers move KV: the vLLM connector and its options."""

    connector: str = "NixlConnector"
    """vLLM KV connector class name; NIXL (over UCX) works on CPU and GPU alike."""
    buffer_device: KvBufferDevice = KvBufferDevice.CPU
    """Device holding transfer buffers; ``cpu`` for vLLM's CPU build."""
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """What a decode worker does when it cannot read the KV (the prefill worker died or its
    lease expired): ``recompute`` prefills locally, so the client still gets its answer;
    vLLM's default ``fail`` answers HTTP 500."""
    kv_lease_s: int = DEFAULT_KV_LEASE_S
    """How long a prefill worker keeps a request's KV for a decode worker that has not read it
    yet. Decode renews the lease while it reads (every lease/6), so this bounds only abandoned
    KV: a client gone between the legs frees the prefill worker's blocks after this long.
    vLLM's default is 30 s; both roles must agree."""
    backends: tuple[str, ...] = ("UCX",)
    """NIXL backends, in order of preference (vLLM's default is UCX alone; GPU clusters may add
    e.g. ``GDS`` or ``LIBFABRIC``)."""
    progress_delay_us: int = 1000
    """Poll timeout of NIXL's UCX progress thread, in µs (``kv_transfer.nixl_progress``).
    NIXL's own is 0, a busy poll that keeps a core at 100 % on every idle worker; the thread is
    woken by transfers either way, so the delay only bounds NIXL's safety-net wake-ups."""
    thread_nice: int = 19
    """Nice value of the threads NIXL starts in each worker (``kv_transfer.nixl_progress``): 19,
    the lowest priority, lets the model's thread, which does the KV copy, keep its core while
    NIXL's progress thread wakes on every completion; on a 2-core host a decode worker's read
    of a 1k-token prompt took half the time (``bench/kv_transfer``). 0 leaves them at the
    worker's."""
    ucx_transports: str | None = None
    """UCX transports the workers may use (their ``UCX_TLS``, e.g. ``cma,tcp``); None leaves
    UCX's default, every transport it finds, which picks per pair of workers: CMA on one host,
    RDMA or TCP across hosts, CUDA IPC between GPUs (see the module docstring). A list must
    hold a transport that carries messages (``tcp`` or an RDMA one): shared memory alone fails
    when NIXL's backend starts."""

    def __post_init__(self) -> None:
        if not 0 <= self.thread_nice <= 19:
            raise ValueError(
                f"thread_nice={self.thread_nice} is out of range: 0 (the worker's priority, "
                "NIXL's threads left alone) to 19 (the lowest)"
            )
        if self.ucx_transports is None:
            return
        names = {name.strip() for name in self.ucx_transports.split(",")}
        if names <= {""}:
            raise ValueError(
                "ucx_transports is empty: leave it unset for UCX's default, or list transports "
                "(UCX_TLS), e.g. 'cma,tcp'"
            )
        if not self.ucx_transports.startswith("^") and names <= _SHARED_MEMORY_ONLY:
            raise ValueError(
                f"ucx_transports={self.ucx_transports!r} has only shared-memory transports, "
                "which NIXL cannot use for its messages (its endpoints need peer failure "
                "handling): add 'tcp' (or an RDMA transport), e.g. 'cma,tcp', or leave it unset"
            )


_ROLE_TO_KV_ROLE = {WorkerRole.PREFILL: "kv_producer", WorkerRole.DECODE: "kv_consumer"}


def kv_transfer_config(role: WorkerRole, config: ConnectorConfig) -> dict[str, Any]:
    """The JSON object passed to a vLLM server as ``--kv-transfer-config``."""
    return {
        "kv_connector": config.connector,
        "kv_role": _ROLE_TO_KV_ROLE[role],
        "kv_buffer_device": config.buffer_device.value,
        "kv_load_failure_policy": config.load_failure_policy,
        "kv_connector_extra_config": {
            "kv_lease_duration": config.kv_lease_s,
            "backends": list(config.backends),
        },
    }


def connector_env(config: ConnectorConfig, host: str, side_channel_port: int) -> dict[str, str]:
    """Environment a worker needs for its connector: where its NIXL side channel listens for
    the KV handshake, the progress-thread delay, NIXL's threads' nice value and the UCX
    transports where configured (else the worker keeps any ``UCX_TLS`` it inherits, or UCX's
    default)."""
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        DELAY_ENV: str(config.progress_delay_us),
        NICE_ENV: str(config.thread_nice),
        # vLLM sets this UCX option itself, but only if NIXL was not imported yet; the plugin
        # that applies the delay imports NIXL first, so the same value is given here.
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
    }
    if config.ucx_transports is not None:
        env["UCX_TLS"] = config.ucx_transports
    return env
