"""Settling an admission runs to the end however the request ends: shielded from a cancel
when the quota store makes a round trip, and without the shield's task when it answers at
once (``AdmissionController.reconcile_to_the_end``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from admission import controller as controller_module
from admission.admitter import AdmissionConfig, Admitter
from admission.controller import Admission, AdmissionController, ControllerConfig
from admission.plans import Plan, QuotaLimits
from admission.quota_memory import MemoryQuotaStore
from admission.tenants import Tenant
from core.prompt import TokenEstimate

TENANT = Tenant("t1", "tenant-1", Plan(tpm=1_000, max_concurrent=4), 0.0, 0.0)
ESTIMATE = TokenEstimate(60, 40, 1)


class RoundTripStore(MemoryQuotaStore):
    """The in-memory store with a round trip in each reconcile, as Redis has: a cancel can
    land while it is under way."""

    answers_at_once = False

    def __init__(self) -> None:
        super().__init__()
        self.reconciles_started = asyncio.Event()

    async def reconcile(self, *args: Any, **kwargs: Any) -> None:
        self.reconciles_started.set()
        await asyncio.sleep(0.05)
        await super().reconcile(*args, **kwargs)


async def _admitted(store: MemoryQuotaStore) -> Admission:
    admitter = Admitter(AdmissionConfig(max_queue=4, max_in_flight=4, default_queue_timeout_s=5))
    controller = AdmissionController(store, admitter, ControllerConfig())
    return await controller.admit(TENANT, ESTIMATE, deadline=None)


async def _concurrent(store: MemoryQuotaStore) -> int:
    snapshot = await store.snapshot(TENANT.tenant_id, QuotaLimits.of(TENANT.plan))
    return snapshot.concurrent


async def test_a_store_that_answers_at_once_is_settled_without_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = MemoryQuotaStore()
    admission = await _admitted(store)
    assert await _concurrent(store) == 1

    def no_shield(awaitable: object) -> None:
        raise AssertionError("a call that never suspends needs no shield, nor its task")

    monkeypatch.setattr(controller_module.asyncio, "shield", no_shield)
    await admission.settle(30)
    assert await _concurrent(store) == 0


async def test_a_cancel_mid_settle_does_not_cut_a_round_trip_short() -> None:
    store = RoundTripStore()
    admission = await _admitted(store)
    settling = asyncio.create_task(admission.settle(30))
    await store.reconciles_started.wait()
    settling.cancel()  # the client leaves while the store's answer is on its way
    with pytest.raises(asyncio.CancelledError):
        await settling
    await asyncio.sleep(0.1)  # the shielded reconcile finishes on its own
    assert await _concurrent(store) == 0
