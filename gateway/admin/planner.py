"""The admin API of the autoscaling planner (``GET /admin/v1/planner``): its mode, interval and
targets, and per deployed version and pool the workers it last read, the size it wants, the
limits, and its latest decisions with their reasons (and the actuator's refusal, if any)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from gateway.admin.deps import AdminDep, require_admin
from gateway.planning import off_status

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
