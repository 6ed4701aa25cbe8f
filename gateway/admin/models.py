"""The admin API for model versions: the registry, deployments, traffic policies, the audit
log, and each version's figures (``/admin/v1/models``, ``/deployments``, ``/traffic``,
``/audit``, ``/versions/{version}/...``).

Every change goes through ``gateway/audited.py`` and so leaves an audit entry naming the admin
key's id and the request's ``reason``. A policy is validated when set (weights sum to 100, its
versions are registered under its alias and have healthy workers here, pinned tenants exist)
and is in force on every replica within their refresh interval (``gateway/catalog.py``).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from billing.cost import MICROS_PER_USD, figures_to_json
from core.errors import ConflictError, InvalidRequestError, NotFoundError
from core.models import GenerationDefaults
from gateway.admin.deps import (
    ActorDep,
    AdminDep,
    refuse_under_rollout,
    require_admin,
    resolve_tenant,
    store_call,
)
from gateway.audited import (
    audit,
    delete_policy,
    delete_version,
    deployment_json,
    register_version,
    set_policy,
)
from gateway.catalog import DeployError, DeploymentSpec, WorkerUrl
from gateway.operations import undeploy as undeploy_deployment
from traffic.policy import (
    PolicyError,
    check_versions,
    policy_from_dict,
    policy_to_dict,
    version_refs,
    with_versions,
)
from versions.manifest import output_affecting_args
from versions.records import ModelVersion, VersionConflictError, VersionSourceError
from versions.store import VersionStore
from workers.deployments import DeploymentExistsError

router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(require_admin)])


class RegisterFields(BaseModel):
    """``POST /admin/v1/models``: a model source to record as a version of ``alias``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    source: str = Field(min_length=1)
    """A GGUF file or Hugging Face folder on the gateway's host, or ``bundled``."""
    alias: str = Field(min_length=1, max_length=64)
    """The ``model`` clients send."""
    dtype: str | None = None
    """The workers' ``--dtype`` (default: the gateway's ``TANDEM_DTYPE``)."""
    defaults: dict[str, Any] = {}
    """Generation defaults: temperature, top_p, max_tokens, system_prompt."""
    engine_args: list[str] = []
    """Further vLLM flags its workers run with (those that change outputs are in its id)."""
    note: str = ""
    reason: str = ""


class DeployFields(BaseModel):
    """``POST /admin/v1/deployments``: workers for a registered version."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    version: str = Field(min_length=1)
    prefill_workers: StrictInt = Field(0, ge=0)  # strict: true is not 1 worker
    decode_workers: StrictInt = Field(1, ge=0)
    prefill_urls: list[WorkerUrl] = []
    decode_urls: list[WorkerUrl] = []
    served_as: str | None = None
    """The model name external workers serve (managed ones serve the version's name)."""
    engine_args: list[str] = []
    """vLLM flags for its managed workers that do not change outputs (``--max-num-seqs``,
    ``--max-num-batched-tokens``): a flag that does belongs to the version (400)."""
    cost_per_hour: Decimal | None = Field(None, ge=0)
    """What each of its workers costs per hour, in the billing currency (other hardware than
    the gateway's default price: ``TANDEM_WORKER_COST_PER_HOUR``); the measured $/1k tokens a
    rollout's cost gate reads."""
    reason: str = ""


@router.post("/models")
async def register_model(
    fields: RegisterFields, services: AdminDep, actor: ActorDep
) -> JSONResponse:
    """Prepare a source if needed and record it as a version (201; 200 if already there)."""
    if services.builder is None:
        raise InvalidRequestError(
            "This gateway cannot prepare models (it runs no supervisor); register on the "
            "gateway `tandem up` started."
        )
    try:
        defaults = GenerationDefaults.from_dict(fields.defaults)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="defaults") from exc
    try:
        version = await services.builder.build(
            fields.source,
            fields.alias,
            dtype=fields.dtype,
            defaults=defaults,
            engine_args=tuple(fields.engine_args),
            note=fields.note,
            actor=actor,
        )
    except VersionSourceError as exc:
        raise InvalidRequestError(str(exc), param="source") from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="alias") from exc
    store = _store(services)
    try:
        stored, created = await store_call(
            register_version(store, version, actor=actor, reason=fields.reason)
        )
    except VersionConflictError as exc:
        raise ConflictError(str(exc), param="source") from exc
    return JSONResponse(_version_json(services, stored), status_code=201 if created else 200)


@router.get("/models")
async def list_models(services: AdminDep, alias: str | None = None) -> dict[str, Any]:
    versions = await store_call(_store(services).list(alias))
    return {"object": "list", "data": [_version_json(services, v) for v in versions]}


@router.get("/models/{ref}")
async def show_model(ref: str, services: AdminDep) -> dict[str, Any]:
    return _version_json(services, await _version(services, ref))


@router.delete("/models/{ref}")
async def delete_model(
    ref: str, services: AdminDep, actor: ActorDep, reason: str = ""
) -> dict[str, Any]:
    """Remove a version from the registry: 409 while a policy names it or it is deployed."""
    version = await _version(services, ref)
    _refuse_in_use(services, version.name, "delete it")
    if services.catalog.deployments.get(version.name) is not None:
        raise ConflictError(
            f"{version.name} is deployed; undeploy it first (DELETE "
            f"/admin/v1/deployments/{version.name}).",
            param="version",
        )
    await store_call(delete_version(_store(services), version, actor=actor, reason=reason))
    return {"deleted": version.name}


@router.get("/deployments")
async def list_deployments(services: AdminDep) -> dict[str, Any]:
    return {"object": "list", "data": [deployment_json(d) for d in services.catalog.deployments]}


@router.post("/deployments", status_code=201)
async def deploy(fields: DeployFields, services: AdminDep, actor: ActorDep) -> dict[str, Any]:
    """Start a registered version's workers (or reach external ones) and route to it once
    they are healthy; it gets traffic when a policy gives it some."""
    if services.deployer is None:
        raise InvalidRequestError("Deployments are fixed on this gateway (it runs no supervisor).")
    version = await _version(services, fields.version)
    deployments = services.catalog.deployments
    if deployments.get(version.name) is not None:
        raise ConflictError(f"{version.name} is already deployed.", param="version")
    try:
        changes_outputs = output_affecting_args(fields.engine_args)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="engine_args") from exc
    if changes_outputs:
        raise InvalidRequestError(
            f"{', '.join(changes_outputs)} change what the model outputs: register a version "
            "with them (POST /admin/v1/models, engine_args) and deploy that one.",
            param="engine_args",
        )
    spec = DeploymentSpec(
        num_prefill=fields.prefill_workers,
        num_decode=fields.decode_workers,
        prefill_urls=tuple(fields.prefill_urls),
        decode_urls=tuple(fields.decode_urls),
        served_as=fields.served_as,
        engine_args=tuple(fields.engine_args),
    )
    if not spec.num_prefill + spec.num_decode and not spec.decode_urls:
        raise InvalidRequestError(
            "A deployment needs a decode worker: set decode_workers or decode_urls.",
            param="decode_workers",
        )
    try:
        deployment = await services.deployer.deploy(version, spec)
    except DeploymentExistsError as exc:  # another call is deploying it right now
        raise ConflictError(f"{version.name} is already deployed.", param="version") from exc
    except DeployError as exc:
        raise InvalidRequestError(str(exc), param="version") from exc
    if services.token_counters is not None:  # not on its first requests' path
        await services.token_counters.load(deployment.model.tokenizer_dir)
    deployments.add(deployment)
    if services.billing is not None:
        model = deployment.model
        price = None if fields.cost_per_hour is None else int(fields.cost_per_hour * MICROS_PER_USD)
        for worker in deployment.workers:
            services.billing.price_worker(
                worker.name, model.deployment, model.version_name, micros_per_hour=price
            )
    await store_call(
        audit(
            _store(services),
            "deployment.create",
            actor=actor,
            alias=version.alias,
            subject=version.name,
            before=None,
            after={
                **deployment_json(deployment),
                "cost_per_hour": None
                if fields.cost_per_hour is None
                else str(fields.cost_per_hour),
            },
            reason=fields.reason,
        )
    )
    return deployment_json(deployment)


@router.delete("/deployments/{version}")
async def undeploy(
    version: str, services: AdminDep, actor: ActorDep, reason: str = ""
) -> dict[str, Any]:
    """Stop routing to a version, wait for its requests in flight, stop its workers: 409
    while its alias's policy still names it."""
    if services.deployer is None:
        raise InvalidRequestError("Deployments are fixed on this gateway (it runs no supervisor).")
    deployment = services.catalog.deployments.get(version)
    if deployment is None:
        raise NotFoundError(f"{version} is not deployed on this gateway.", param="version")
    _refuse_in_use(services, version, "undeploy it")
    await refuse_under_rollout(services, deployment.model.name, f"undeploy {version}", version)
    await store_call(
        undeploy_deployment(
            _store(services),
            services.catalog,
            services.deployer,
            deployment,
            actor=actor,
            reason=reason,
        )
    )
    return {"undeployed": version}


@router.get("/traffic")
async def list_policies(services: AdminDep) -> dict[str, Any]:
    stored = await store_call(_store(services).list_policies())
    return {"object": "list", "data": [{"alias": a, **p} for a, p in sorted(stored.items())]}


@router.get("/traffic/{alias}")
async def show_policy(alias: str, services: AdminDep) -> dict[str, Any]:
    policy = await store_call(_store(services).get_policy(alias))
    if policy is None:
        raise NotFoundError(f"No traffic policy for '{alias}'.", param="alias")
    return {"alias": alias, **policy}


@router.put("/traffic/{alias}")
async def put_policy(
    alias: str, body: dict[str, Any], services: AdminDep, actor: ActorDep
) -> dict[str, Any]:
    """Set ``alias``'s policy (the JSON shape of ``traffic/policy.py``, plus ``reason``)."""
    body = dict(body)
    reason = body.pop("reason", "")
    if not isinstance(reason, str):
        raise InvalidRequestError("reason: a string", param="reason")
    await refuse_under_rollout(services, alias, "set its policy")
    data = await _canonical_policy(services, alias, body)
    await store_call(set_policy(_store(services), alias, data, actor=actor, reason=reason))
    # This replica applies it now; the others within their refresh interval.
    await store_call(services.catalog.refresh())
    return {"alias": alias, **data}


@router.delete("/traffic/{alias}")
async def remove_policy(
    alias: str, services: AdminDep, actor: ActorDep, reason: str = ""
) -> dict[str, Any]:
    await refuse_under_rollout(services, alias, "delete its policy")
    removed = await store_call(delete_policy(_store(services), alias, actor=actor, reason=reason))
    if not removed:
        raise NotFoundError(f"No traffic policy for '{alias}'.", param="alias")
    await store_call(services.catalog.refresh())
    return {"deleted": alias}


@router.get("/audit")
async def audit_log(
    services: AdminDep,
    alias: str | None = None,
    since: Annotated[float | None, Query(description="Unix seconds, inclusive")] = None,
    until: Annotated[float | None, Query(description="Unix seconds, exclusive")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> dict[str, Any]:
    entries = await store_call(
        _store(services).audit(alias=alias, since=since, until=until, limit=limit)
    )
    return {"object": "list", "data": [entry.to_dict() for entry in entries]}


@router.get("/versions/{version}/figures")
async def version_figures(
    version: str,
    services: AdminDep,
    window_s: Annotated[float, Query(gt=0, le=3600)] = 300.0,
) -> dict[str, Any]:
    """The version's sliding-window figures (primary and shadow traffic apart), measured
    cost per 1k tokens, and its shadow copies sent and dropped: what rollout gates read."""
    windows = services.windows
    figures: dict[str, Any] = {
        "version": version,
        "window_s": window_s,
        "primary": windows.snapshot(version, window_s).to_dict(),
        "shadow": windows.snapshot(version, window_s, shadow=True).to_dict(),
        "shadow_copies": {
            "sent": services.shadow_limiter.sent(version),
            "dropped": services.shadow_limiter.dropped(version),
            "in_flight": services.shadow_limiter.in_flight(version),
        },
    }
    billing = services.billing
    if billing is not None and billing.cost_meter is not None:
        cost = figures_to_json(
            [f for f in billing.cost_meter.snapshot() if f.model_version == version]
        )
        figures["cost"] = {"currency": billing.config.currency, **cost}
    return figures


@router.get("/versions/{version}/shadow")
async def shadow_comparisons(version: str, services: AdminDep) -> dict[str, Any]:
    """The latest comparisons of ``version``'s shadow answers with their primaries'."""
    compared = services.shadow_comparisons(version)
    same = sum(1 for c in compared if c["same_text"])
    return {
        "version": version,
        "num_compared": len(compared),
        "num_same_text": same,
        "data": compared,
    }


async def _canonical_policy(services: AdminDep, alias: str, body: dict[str, Any]) -> dict[str, Any]:
    """The policy with versions named canonically (``alias@8hex``) and tenants by id,
    validated against the registry and this gateway's deployments; 400 naming the field."""
    body = await _with_names(services, alias, body)
    try:
        policy = policy_from_dict(alias, body)
        deployments = services.catalog.deployments
        check_versions(
            policy,
            exists=lambda name: name.startswith(f"{alias}@"),  # _with_names looked them up
            has_workers=lambda name: (d := deployments.get(name)) is not None and d.healthy,
        )
    except PolicyError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from exc
    return policy_to_dict(policy)


async def _with_names(services: AdminDep, alias: str, body: dict[str, Any]) -> dict[str, Any]:
    """Version references (id, prefix or name) replaced by names; pinned tenants by id."""

    async def name_of(ref: Any, param: str) -> str:
        if not isinstance(ref, str) or not ref:
            raise InvalidRequestError(f"{param}: a version name or id", param=param)
        version = await store_call(_store(services).get(ref))
        if version is None:
            raise InvalidRequestError(
                f"{param}: no registered version '{ref}' (see GET /admin/v1/models).",
                param=param,
            )
        if version.alias != alias:
            raise InvalidRequestError(
                f"{param}: {version.name} is a version of '{version.alias}', not '{alias}'.",
                param=param,
            )
        return version.name

    names = {field: await name_of(ref, field) for field, ref in version_refs(body)}
    body = with_versions(body, names)
    if isinstance(body.get("pins"), list):  # with_versions made the list a copy of its own
        for i, pin in enumerate(body["pins"]):
            if isinstance(pin, dict) and isinstance(pin.get("tenant"), str):
                try:
                    tenant = await resolve_tenant(services.registry, pin["tenant"])
                except NotFoundError as exc:
                    raise InvalidRequestError(str(exc.message), param=f"pins[{i}].tenant") from exc
                pin["tenant"] = tenant.tenant_id
    return body


def _refuse_in_use(services: AdminDep, version: str, action: str) -> None:
    for alias, policy in services.catalog.policies().items():
        if version in policy.versions():
            raise ConflictError(
                f"The traffic policy of '{alias}' names {version}; change it (PUT "
                f"/admin/v1/traffic/{alias}) before you {action}.",
                param="version",
            )


async def _version(services: AdminDep, ref: str) -> ModelVersion:
    version = await store_call(_store(services).get(ref))
    if version is None:
        raise NotFoundError(
            f"No model version '{ref}' (see GET /admin/v1/models).", param="version"
        )
    return version


def _store(services: AdminDep) -> VersionStore:
    store = services.catalog.store
    if store is None:
        raise NotFoundError("This gateway keeps no version registry.")
    return store


def _version_json(services: AdminDep, version: ModelVersion) -> dict[str, Any]:
    policies = services.catalog.policies()
    return {
        **version.to_dict(),
        "deployed": services.catalog.deployments.get(version.name) is not None,
        "in_policy": sorted(a for a, p in policies.items() if version.name in p.versions()),
    }
