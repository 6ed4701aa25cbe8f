"""Decode workers: their specs (kv_consumer) and their pool."""

from __future__ import annotations

from core.messages import WorkerRole
from workers.pool import WorkerPool
from workers.process import LaunchConfig, WorkerSpec, numbered_specs

DEFAULT_BASE_PORT = 8200
"""HTTP port of decode-0; worker i listens on base + i."""
DEFAULT_BASE_SIDE_CHANNEL_PORT = 5700
"""NIXL side-channel port of decode-0; worker i uses base + i (distinct from the other pool's)."""


def decode_worker_specs(
    launch: LaunchConfig,
    *,
    num_workers: int = 1,
    base_port: int = DEFAULT_BASE_PORT,
    base_side_channel_port: int = DEFAULT_BASE_SIDE_CHANNEL_PORT,
    cpu_binds: tuple[str | None, ...] = (),
) -> tuple[WorkerSpec, ...]:
    """Specs for ``decode-0..n-1``, launched as kv_consumers; ``cpu_binds[i]`` pins worker i."""
    return numbered_specs(
        WorkerRole.DECODE,
        launch,
        num_workers=num_workers,
        base_port=base_port,
        base_side_channel_port=base_side_channel_port,
        cpu_binds=cpu_binds,
    )


class DecodePool(WorkerPool):
    """The decode workers, managed and external; ``pick()`` chooses one for a request."""

    role = WorkerRole.DECODE
