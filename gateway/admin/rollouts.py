"""The admin API for rollouts (``/admin/v1/rollouts``): start one, watch it, steer it.

Starting a rollout only records it; the gateway holding the rollout lease runs it (see
``rollouts/controller.py``). Commands (``pause``, ``resume``, ``promote``, ``abort``) are queued
in the rollout store from any gateway and applied by the lease holder on its next pass: the
route waits up to ``_COMMAND_WAIT_S`` for that and answers 200 with the rollout as it then
stands, or 202 when the command is queued but not applied yet.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Query
from fastapi.responses import FileResponse, JSONResponse

from core.errors import ConflictError, InvalidRequestError, NotFoundError
from gateway.admin.deps import ActorDep, AdminDep, require_admin, store_call
from rollouts import machine
from rollouts.record import Rollout, new_rollout_id
from rollouts.spec import SpecError, gates_for, spec_from_dict
from rollouts.store import RolloutConflictError, RolloutStore

router = APIRouter(
    prefix="/admin/v1/rollouts", tags=["admin"], dependencies=[Depends(require_admin)]
)

_COMMAND_WAIT_S = 3.0
_REPORT_FILES = frozenset({"latency.png", "weights.png", "decisions.md", "report.json"})


@router.post("", status_code=201)
async def start_rollout(
    body: Annotated[dict[str, Any], Body()], services: AdminDep, actor: ActorDep
) -> dict[str, Any]:
    """Record a rollout (the JSON shape of ``rollouts/spec.py``, plus ``reason``): 409 while
    another runs for the alias; 400 naming the field for a bad spec or a version that is not
    deployed and healthy here."""
    store = _store(services)
    fields = dict(body)
    reason = fields.pop("reason", "")
    if not isinstance(reason, str):
        raise InvalidRequestError("reason: a string", param="reason")
    try:
        spec = spec_from_dict(await _with_names(services, fields))
    except SpecError as exc:
        raise InvalidRequestError(exc.message, param=exc.param) from exc
    for param, version in (("baseline", spec.baseline), ("candidate", spec.candidate)):
        deployment = services.catalog.deployments.get(version)
        if deployment is None or not deployment.healthy:
            raise InvalidRequestError(
                f"{version} has no healthy workers on this gateway: deploy it first "
                "(POST /admin/v1/deployments).",
                param=param,
            )
    billing = services.billing
    spec = spec.with_gates(
        gates_for(spec, cost=billing is not None and billing.cost_meter is not None)
    )
    now = time.time()
    rollout = Rollout(new_rollout_id(), spec, now, actor, reason)
    machine.begin(rollout, now, actor)
    try:
        await store_call(store.create(rollout.to_dict()))
    except RolloutConflictError as exc:
        raise ConflictError(str(exc), param="alias") from exc
    return rollout.public_dict()


@router.get("")
async def list_rollouts(
    services: AdminDep,
    alias: str | None = None,
    active: bool | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> dict[str, Any]:
    """Newest first; ``active=true``: running or paused, ``false``: finished (the history)."""
    records = await store_call(_store(services).list(alias=alias, active=active, limit=limit))
    return {"object": "list", "data": [Rollout.from_dict(r).public_dict() for r in records]}


@router.get("/{rollout_id}")
async def show_rollout(rollout_id: str, services: AdminDep) -> dict[str, Any]:
    return (await _rollout(services, rollout_id)).public_dict()


@router.post("/{rollout_id}/{action}")
async def steer_rollout(
    rollout_id: str,
    action: Literal["pause", "resume", "promote", "abort"],
    services: AdminDep,
    actor: ActorDep,
    body: Annotated[dict[str, Any] | None, Body()] = None,
) -> JSONResponse:
    """Queue ``action`` for the lease holder; the rollout once it is applied (200), or as it
    stands when it is not yet (202)."""
    reason = (body or {}).get("reason", "")
    if not isinstance(reason, str):
        raise InvalidRequestError("reason: a string", param="reason")
    rollout = await _rollout(services, rollout_id)
    if not rollout.status.active:
        raise ConflictError(
            f"Rollout {rollout_id} is {rollout.status.value}; there is nothing to {action}.",
            param="rollout_id",
        )
    store = _store(services)
    command = {"action": action, "actor": actor, "reason": reason, "at": time.time()}
    seq = await store_call(store.push_command(rollout_id, command))
    deadline = time.monotonic() + _COMMAND_WAIT_S
    while rollout.last_command_seq < seq and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        rollout = await _rollout(services, rollout_id)
    applied = rollout.last_command_seq >= seq
    return JSONResponse(
        {**rollout.public_dict(), "command": {"seq": seq, "action": action, "applied": applied}},
        status_code=200 if applied else 202,
    )


@router.get("/{rollout_id}/report/{name}")
async def report_file(rollout_id: str, name: str, services: AdminDep) -> FileResponse:
    """One file of a finished rollout's report (``latency.png``, ``weights.png``,
    ``decisions.md``, ``report.json``), from the gateway that wrote it."""
    rollout = await _rollout(services, rollout_id)
    folder = services.rollout_reports
    if name not in _REPORT_FILES or name not in rollout.report:
        raise NotFoundError(
            f"Rollout {rollout_id} has no report file {name!r}; it has: "
            f"{', '.join(rollout.report) or 'none (not finished yet)'}.",
            param="name",
        )
    path = None if folder is None else folder / rollout_id / name
    if path is None or not path.is_file():
        raise NotFoundError(
            f"The report of {rollout_id} was written by another gateway (the lease holder "
            "when it ended); ask that one.",
            param="name",
        )
    return FileResponse(path)


async def _with_names(services: AdminDep, fields: dict[str, Any]) -> dict[str, Any]:
    """The spec's fields with its versions named canonically (an id or a prefix becomes its
    name); what is not a string is left for the spec's own checks."""
    store = services.catalog.store
    if store is None:
        raise NotFoundError("This gateway keeps no version registry.")
    alias = fields.get("alias")
    named = dict(fields)
    for param in ("baseline", "candidate"):
        ref = fields.get(param)
        if not isinstance(alias, str) or not isinstance(ref, str) or not ref:
            continue
        version = await store_call(store.get(ref))
        if version is None or version.alias != alias:
            raise InvalidRequestError(
                f"No version {ref!r} of {alias!r} (see GET /admin/v1/models).", param=param
            )
        named[param] = version.name
    return named


async def _rollout(services: AdminDep, rollout_id: str) -> Rollout:
    record = await store_call(_store(services).get(rollout_id))
    if record is None:
        raise NotFoundError(f"No rollout {rollout_id!r}.", param="rollout_id")
    return Rollout.from_dict(record)


def _store(services: AdminDep) -> RolloutStore:
    if services.rollouts is None:
        raise NotFoundError("This gateway runs no rollouts.")
    return services.rollouts
