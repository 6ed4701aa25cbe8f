"""The UCX transports a worker's environment names (issue 24)."""

from __future__ import annotations

import pytest

from kv_transfer.connector import ConnectorConfig, connector_env


def test_ucx_picks_per_pair_unless_transports_are_configured() -> None:
    # No UCX_TLS: the worker keeps what it inherits, or UCX's default (CMA on one host, RDMA
    # or TCP across hosts), which measured fastest here.
    assert "UCX_TLS" not in connector_env(ConnectorConfig(), "127.0.0.1", 5600)
    env = connector_env(ConnectorConfig(ucx_transports="cma,tcp"), "127.0.0.1", 5600)
    assert env["UCX_TLS"] == "cma,tcp"


@pytest.mark.parametrize("transports", ["sm", "cma", "posix,sysv", "cma, self"])
def test_shared_memory_alone_is_refused_with_the_fix(transports: str) -> None:
    # Measured: NIXL's UCX backend fails to start with these ("no active messages transport").
    with pytest.raises(ValueError, match=r"ucx_transports=.*add 'tcp'"):
        ConnectorConfig(ucx_transports=transports)


@pytest.mark.parametrize("transports", ["", " , "])
def test_an_empty_list_is_refused(transports: str) -> None:
    with pytest.raises(ValueError, match="ucx_transports is empty"):
        ConnectorConfig(ucx_transports=transports)


@pytest.mark.parametrize("transports", ["tcp", "sm,tcp", "cma,tcp", "all", "^ib", "rc,cma"])
def test_lists_with_a_message_transport_are_accepted(transports: str) -> None:
    assert ConnectorConfig(ucx_transports=transports).ucx_transports == transports
