"""Fixtures of the fuzz tests: the gateways they run against (``gateways.py``); how they drive
schemathesis is ``fuzzing.py``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fuzz.fuzzing import RUNNING_LIMITS
from tests.fuzz.gateways import Gateway, in_process_gateway, running_gateway


@pytest.fixture(autouse=True)
def _node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    # schemathesis 4.32's fixture-loaded schemas rename the test node through ``_nodeid``, which
    # pytest 9 no longer has; the attribute it reads and writes is given back here.
    request.node._nodeid = request.node.nodeid


@pytest.fixture
def in_process() -> Iterator[Gateway]:
    """The app in-process (ASGI) over fake engines, with the default limits. One per test:
    schemathesis' pytest plugin ends every ASGI app's lifespan when a test ends, and an app's
    lifespan runs once."""
    with in_process_gateway() as gateway:
        yield gateway


@pytest.fixture(scope="session")
def running() -> Iterator[Gateway]:
    """``tandem up`` over a fake engine, with ``RUNNING_LIMITS``: the fuzz run against a
    server and the limits' tests share it."""
    with running_gateway(RUNNING_LIMITS) as gateway:
        yield gateway
