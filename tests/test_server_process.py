"""Ports for servers a test restarts: below the kernel's ephemeral range, each block handed
out once while any is left."""

from __future__ import annotations

from pathlib import Path

from tests.server_process import RESTARTABLE_PORTS, free_port_block


def test_restartable_ports_lie_below_the_kernels_ephemeral_range() -> None:
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    base = free_port_block(8)

    assert base in RESTARTABLE_PORTS
    assert base + 8 <= low


def test_a_block_handed_out_is_not_handed_out_again_before_it_is_bound() -> None:
    first, second = free_port_block(8), free_port_block(1)

    assert second not in range(first, first + 8)


def test_once_every_block_was_handed_out_the_free_ones_are_handed_out_again() -> None:
    for _ in RESTARTABLE_PORTS:
        free_port_block(1)

    assert free_port_block(1) in RESTARTABLE_PORTS  # not "no free ports"
