"""The admin API of the autoscaling planner.

- ``GET /admin/v1/planner``: its mode, whether it is paused, interval and targets, and per
  deployed version and pool the workers it last read (serving, starting, draining), the size it
  wants, the limits, and its latest decisions with their reasons (and the actuator's refusal).
- ``POST /admin/v1/planner/pause`` and ``/resume`` (optional body ``{"reason": "..."}``): hold
  the planner's changes (it goes on stepping and reporting) and let them go again; audited
  (``planner.pause``, ``planner.resume``). This gateway's planner: with several gateways, each
  pauses its own.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends

from core.errors import ConflictError, InvalidRequestError
from gateway.admin.deps import ActorDep, AdminDep, require_admin, store_call
from gateway.audited import audit
from gateway.planning import GatewayPlanner, off_status

router = APIRouter(
    prefix="/admin/v1/planner", tags=["admin"], dependencies=[Depends(require_admin)]
)


@router.get("")
async def planner_status(services: AdminDep) -> dict[str, Any]:
    """This gateway's planner (``mode: off`` and no versions when it does not run one; with the
    Kubernetes actuator, only the lease holder lists versions)."""
    if services.planner is None:
        return off_status()
    return services.planner.status()


@router.post("/pause")
async def pause_planner(
    services: AdminDep, actor: ActorDep, body: Annotated[dict[str, Any] | None, Body()] = None
) -> dict[str, Any]:
    """Hold the planner's changes until resumed; its status still says what it would do."""
    return await _set_paused(services, actor, body, paused=True)


@router.post("/resume")
async def resume_planner(
    services: AdminDep, actor: ActorDep, body: Annotated[dict[str, Any] | None, Body()] = None
) -> dict[str, Any]:
    """Let the planner's changes go again (its next step may act at once)."""
    return await _set_paused(services, actor, body, paused=False)


async def _set_paused(
    services: AdminDep, actor: str, body: dict[str, Any] | None, *, paused: bool
) -> dict[str, Any]:
    """Pause or resume; audited when it changes anything. The status after."""
    reason = _reason(body)
    planner = _running(services.planner)
    if planner.paused != paused:
        if paused:
            planner.pause()
        else:
            planner.resume()
        await _audit(services, "planner.pause" if paused else "planner.resume", actor, reason)
    return planner.status()


def _running(planner: GatewayPlanner | None) -> GatewayPlanner:
    if planner is None:
        raise ConflictError(
            "This gateway runs no planner (TANDEM_PLANNER=off): there is nothing to pause or "
            "resume. Set TANDEM_PLANNER=local, kubernetes or dry-run to run one."
        )
    return planner


def _reason(body: dict[str, Any] | None) -> str:
    reason = (body or {}).get("reason", "")
    if not isinstance(reason, str):
        raise InvalidRequestError("'reason' must be a string.", param="reason")
    return reason


async def _audit(services: AdminDep, action: str, actor: str, reason: str) -> None:
    store = services.catalog.store
    if store is None:
        return
    await store_call(
        audit(store, action, actor=actor, alias=None, subject="planner", before=None,
              after=None, reason=reason)
    )  # fmt: skip
