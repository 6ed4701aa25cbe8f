"""Prefill workers: their specs (kv_producer) and their pool."""

from __future__ import annotations

from core.messages import WorkerRole
from workers.pool import WorkerPool
from workers.process import LaunchConfig, WorkerSpec, numbered_specs

DEFAULT_BASE_PORT = 8100
"""HTTP port of prefill-0; worker i listens on base + i."""
DEFAULT_BASE_SIDE_CHANNEL_PORT = 5600
"""NIXL side-channel port of prefill-0; worker i uses base + i (distinct from the other pool's)."""


def prefill_worker_specs(
    launch: LaunchConfig,
    *,
    num_workers: int = 1,
    base_port: int = DEFAULT_BASE_PORT,
    base_side_channel_port: int = DEFAULT_BASE_SIDE_CHANNEL_PORT,
    cpu_binds: tuple[str | None, ...] = (),
) -> tuple[WorkerSpec, ...]:
    """Specs for ``prefill-0..n-1``, launched as kv_producers; ``cpu_binds[i]`` pins worker i."""
    return numbered_specs(
        WorkerRole.PREFILL,
        launch,
        num_workers=num_workers,
        base_port=base_port,
        base_side_channel_port=base_side_channel_port,
        cpu_binds=cpu_binds,
    )


class PrefillPool(WorkerPool):
    """The prefill workers, managed and external; ``pick()`` chooses one for a request."""

    role = WorkerRole.PREFILL
