"""vLLM ``--kv-transfer-config`` for each worker role, generated in one place for CPU and GPU."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal

from core.messages import WorkerRole
from kv_transfer.nixl_progress import DELAY_ENV


class KvBufferDevice(enum.StrEnum):
    """Where NIXL stages KV blocks: host memory on CPU workers, device memory on GPUs."""

    CPU = "cpu"
    CUDA = "cuda"


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
    the KV handshake, and the progress-thread delay."""
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        DELAY_ENV: str(config.progress_delay_us),
        # vLLM sets this UCX option itself, but only if NIXL was not imported yet; the plugin
        # that applies the delay imports NIXL first, so the same value is given here.
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
    }
