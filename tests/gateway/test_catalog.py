"""The catalog on its own: policies followed from a real store, kept through an outage."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from core.errors import ModelNotFoundError, NoHealthyWorkerError
from core.models import ServedModel
from gateway.catalog import Catalog
from traffic.resolver import Subject
from versions.store_sqlite import SqliteVersionStore
from workers.deployments import Deployment, Deployments
from workers.registry import Worker

ALIAS = "smol"
V1, V2, GONE = f"{ALIAS}@11111111", f"{ALIAS}@22222222", f"{ALIAS}@33333333"
WHO = Subject("tenant-1", "key-1")


class _Pool:
    workers: tuple[Worker, ...] = ()
    kv_watermark = 1.0

    def pick(self) -> Worker | None:
        return None


def _deployments() -> Deployments:
    pool = _Pool()
    return Deployments([Deployment(ServedModel(ALIAS, 256, 0, v), pool, pool) for v in (V1, V2)])


def _only(version: str) -> dict[str, object]:
    return {"split": [{"version": version, "weight": 100}]}


async def test_policies_are_followed_and_kept_through_a_store_outage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = SqliteVersionStore(tmp_path / "versions.db")
    await store.start()
    catalog = Catalog(_deployments(), store, refresh_interval_s=0.02)
    await catalog.start()
    try:
        assert catalog.resolve(ALIAS, WHO).deployment.version == V1  # no policy: the first
        await store.put_policy(ALIAS, _only(V2))
        await asyncio.sleep(0.1)
        resolved = catalog.resolve(ALIAS, WHO)
        assert (resolved.deployment.version, resolved.reason) == (V2, "only")

        await store.aclose()  # every read fails from now on

        def said() -> list[logging.LogRecord]:
            return [r for r in caplog.records if "cannot read traffic policies" in r.getMessage()]

        # caplog's handler on the logger itself: what other tests did to the parents' levels
        # or propagation in this process does not matter.
        gateway_log = logging.getLogger("tandem.gateway")
        gateway_log.disabled = False  # a logging config run earlier in the process may have
        gateway_log.addHandler(caplog.handler)
        with caplog.at_level(logging.WARNING, logger="tandem.gateway"):
            # Polled, not a fixed sleep: on a loaded machine the first round may come late.
            deadline = time.monotonic() + 5
            while not said():
                assert time.monotonic() < deadline, "no warning about the outage"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # about ten more failed rounds
        gateway_log.removeHandler(caplog.handler)
        assert catalog.resolve(ALIAS, WHO).deployment.version == V2, "the table in force stays"
        # Once per outage (the handler on the logger and the root's may both have seen it).
        assert len({id(r) for r in said()}) == 1, "one warning per outage"
    finally:
        await catalog.aclose()
        await store.aclose()


async def test_a_policy_naming_a_version_without_workers_here_is_a_503(tmp_path: Path) -> None:
    store = SqliteVersionStore(tmp_path / "versions.db")
    await store.start()
    await store.put_policy(ALIAS, _only(GONE))
    catalog = Catalog(_deployments(), store)
    await catalog.start()
    try:
        with pytest.raises(NoHealthyWorkerError, match=GONE):
            catalog.resolve(ALIAS, WHO)
        assert catalog.resolve(V1, WHO).reason == "direct"
        with pytest.raises(ModelNotFoundError) as caught:
            catalog.resolve("other", WHO)
        assert caught.value.param == "model"
    finally:
        await catalog.aclose()
        await store.aclose()
