"""Assembling a whole stack from settings (or a configuration file): its versions, each
one's worker pools, the gateway app.

``tandem up`` and the end-to-end tests build the stack the same way, through ``Stack``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from admission.controller import ControllerConfig, StoreFailurePolicy
from billing.service import BillingConfig
from core.models import ServedModel
from core.moderation import ModerationPolicy
from gateway.assembly.admin_key import load_or_create_admin_key
from gateway.assembly.app import (
    AccessConfig,
    GatewayConfig,
    RolloutsConfig,
    VersionsConfig,
    create_app,
)
from gateway.assembly.config_file import ConfigFileError, StackFile, with_version_names
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stores import StoreConfig
from gateway.assembly.supervisor import LocalVersionBuilder, Supervisor, connector_config
from gateway.auth_throttle import AuthThrottleConfig
from gateway.catalog import DeploymentSpec
from gateway.limits import RequestLimits
from gateway.local_actuator import WorkerBudget, host_memory_gib
from gateway.planning import PlannerConfig
from gateway.serving.content_policy import ModerationSetup
from gateway.serving.deadlines import DeadlineConfig
from gateway.serving.gate import GateConfig
from gateway.serving.idempotent import IdempotencyConfig
from gateway.serving.upstream import UpstreamConfig
from kv_transfer.decider import DeciderConfig
from moderation.remote import RemoteProviderConfig
from moderation.stream import StreamConfig
from planner.profile import Profile
from planner.replicas import Targets
from planner.scaling import ScalingPolicy
from telemetry.otlp_metrics import OtlpMetricsConfig
from telemetry.tracing import TracingConfig
from traffic.policy import PolicyError, check_versions, policy_from_dict, policy_to_dict
from versions.records import ModelVersion
from workers.deployments import Deployments
from workers.pool import WorkerPool

log = logging.getLogger("tandem.gateway")


@dataclass(slots=True)
class Stack:
    """Every deployed version's pools and the app over them. ``start()`` boots workers;
    ``aclose()`` stops them (those deployed later through the admin API too)."""

    settings: TandemSettings
    supervisor: Supervisor
    deployments: Deployments
    declared: VersionsConfig
    """The versions and policies recorded (and audited) when the app starts."""
    model_dir: Path | None = None
    """The first version's model folder (its tokenizer counts prompt tokens); for
    external-only, ``settings.tokenizer_dir``."""
    tracing: TracingConfig = field(default_factory=TracingConfig)
    """Where the gateway and its workers export traces (the ``OTEL_*`` environment)."""
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    """The autoscaling planner, its worker profile loaded."""
    process_index: int = 0
    """Which gateway process serves this app (0: ``tandem up`` itself); each has its own
    ledger spool."""
    num_processes: int = 1
    """Gateway processes serving the stack together. Above 1, versions are fixed at start:
    one deployed at runtime would reach the process that deployed it only."""

    @classmethod
    def from_settings(
        cls,
        settings: TandemSettings,
        version: ModelVersion | None,
        planner: PlannerConfig | None = None,
    ) -> Stack:
        """One version on the settings' workers (the one-version default); ``version`` is
        required when any worker is managed (``fingerprint`` makes it). ``planner``: loaded
        already (``planner_config``), else loaded here."""
        num_managed = settings.num_prefill_workers + settings.num_decode_workers
        if version is None and num_managed:
            raise ValueError("managed workers need a prepared, fingerprinted model")
        spec = DeploymentSpec(
            num_prefill=settings.num_prefill_workers,
            num_decode=settings.num_decode_workers,
            prefill_urls=tuple(settings.prefill_urls),
            decode_urls=tuple(settings.decode_urls),
            served_as=settings.served_model_name if version is None else None,
        )
        return cls.of_versions(settings, [(version, spec)], {}, planner)

    @classmethod
    def from_file(
        cls,
        settings: TandemSettings,
        stack_file: StackFile,
        versions: Sequence[ModelVersion],
        path: Path,
        planner: PlannerConfig | None = None,
    ) -> Stack:
        """The versions a configuration file declares (``versions[i]`` fingerprints its
        ``i``-th entry), with its traffic policies checked now, before any worker boots."""
        names = {
            entry.label: v.name for entry, v in zip(stack_file.versions, versions, strict=True)
        }
        policies: dict[str, dict[str, Any]] = {}
        for alias, raw in stack_file.traffic.items():
            where = f"{path}: traffic.{alias}"
            policy = with_version_names(raw, names, where)
            try:
                parsed = policy_from_dict(alias, policy)
                declared = {name for name in names.values() if name.startswith(f"{alias}@")}
                check_versions(
                    parsed,
                    exists=declared.__contains__,  # a version of another alias is not one
                    has_workers=declared.__contains__,
                )
            except PolicyError as exc:
                raise ConfigFileError(f"{where}.{exc.param}: {exc}") from exc
            policies[alias] = policy_to_dict(parsed)
        planned = [
            (version, entry.spec)
            for entry, version in zip(stack_file.versions, versions, strict=True)
        ]
        return cls.of_versions(settings, planned, policies, planner)

    @classmethod
    def of_versions(
        cls,
        settings: TandemSettings,
        planned: Sequence[tuple[ModelVersion | None, DeploymentSpec]],
        policies: dict[str, dict[str, Any]],
        planner: PlannerConfig | None = None,
    ) -> Stack:
        """``ProfileError`` when the planner is on and its profile is missing or unusable."""
        planner = planner if planner is not None else planner_config(settings)
        tracing = TracingConfig.from_env()
        supervisor = Supervisor(settings, tracing)
        deployments = Deployments([supervisor.plan(version, spec) for version, spec in planned])
        registered = tuple(version for version, _ in planned if version is not None)
        first = planned[0][0]
        return cls(
            settings,
            supervisor,
            deployments,
            VersionsConfig(register=registered, policies=tuple(policies.items())),
            Path(first.model_dir) if first is not None else settings.tokenizer_dir,
            tracing,
            planner,
        )

    @property
    def model(self) -> ServedModel:
        """The first deployed version."""
        return next(iter(self.deployments)).model

    @property
    def prefill(self) -> WorkerPool:
        """The first version's prefill pool."""
        return self.supervisor.pools()[0]

    @property
    def decode(self) -> WorkerPool:
        """The first version's decode pool."""
        return self.supervisor.pools()[1]

    async def start(self, on_progress: Callable[[str], None] | None = None) -> None:
        """Launch every managed worker and wait until all workers are healthy."""
        await asyncio.gather(*(self.supervisor.start(d) for d in self.deployments))
        timeout_s = self.settings.worker_ready_timeout_s

        def report(pool: WorkerPool) -> Callable[[str], None] | None:
            if on_progress is None:
                return None
            return lambda line: on_progress(f"{pool.config.role.value}: {line}")

        await asyncio.gather(
            *(pool.wait_ready(timeout_s, report(pool)) for pool in self.supervisor.pools())
        )

    async def aclose(self) -> None:
        """Stop every pool; no worker process is left behind."""
        await self.supervisor.aclose()

    def app(self) -> FastAPI:
        """The gateway app over this stack's pools."""
        settings = self.settings
        config = GatewayConfig(
            upstream=UpstreamConfig(
                connect_timeout_s=settings.connect_timeout_s,
                prefill_timeout_s=settings.prefill_timeout_s,
                decode_idle_timeout_s=settings.decode_idle_timeout_s,
                first_byte_timeout_s=settings.decode_first_byte_timeout_s,
            ),
            sse_ping_interval_s=settings.sse_ping_interval_s,
            deadlines=DeadlineConfig(
                default_s=settings.request_timeout_s, max_s=settings.max_request_timeout_s
            ),
            decider=DeciderConfig(
                min_prompt_tokens=settings.disaggregate_min_prompt_tokens,
                interference_budget=settings.interference_budget,
            ),
            connector=connector_config(settings),
            access=access_config(settings, self.model_dir),
            moderation=moderation_setup(settings),
            idempotency=IdempotencyConfig(retention_s=settings.idempotency_retention_s),
            billing=billing_config(settings, self.process_index),
            versions=self.declared,
            rollouts=RolloutsConfig(
                tick_s=settings.rollout_tick_s,
                lease_ttl_s=settings.rollout_lease_ttl_s,
                reports_dir=settings.state_dir / "rollouts",
                window_bucket_s=settings.rollout_window_bucket_s,
                prometheus_url=settings.rollout_prometheus_url,
            ),
            planner=self.planner,
            tracing=self.tracing,
            otlp_metrics=OtlpMetricsConfig.from_env(),
            limits=request_limits(settings),
        )
        alone = self.num_processes == 1
        return create_app(
            config,
            self.deployments,
            LocalVersionBuilder(settings),
            self.supervisor if alone else None,
            launcher=self.supervisor if alone else None,
        )


def request_limits(settings: TandemSettings) -> RequestLimits:
    """What one request may send: the app's body limits and the HTTP server's head limits."""
    return RequestLimits(
        max_body_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        header_timeout_s=settings.header_timeout_s,
    )


def planner_config(settings: TandemSettings) -> PlannerConfig:
    """The planner as the settings ask, its worker profile read from its file: ``ProfileError``
    (naming ``tandem profile``) when the planner is on and the file is missing or unusable."""
    if settings.planner == "off":
        return PlannerConfig()
    path = settings.planner_profile or settings.state_dir / "profile.json"
    windows = {
        "up_window_s": settings.planner_up_window_s,
        "down_window_s": settings.planner_down_window_s,
        "cooldown_s": settings.planner_cooldown_s,
        "tolerance": settings.planner_tolerance,
    }
    return PlannerConfig(
        mode=settings.planner,
        profile=Profile.load(path),
        interval_s=settings.planner_interval_s,
        targets=Targets(
            ttft_s=settings.planner_ttft_target_s,
            itl_s=settings.planner_itl_target_s,
            headroom=settings.planner_headroom,
            kv_usage=settings.planner_kv_usage_target,
        ),
        prefill=ScalingPolicy(
            min_replicas=settings.planner_prefill_min_replicas,
            max_replicas=settings.planner_prefill_max_replicas,
            **windows,
        ),
        decode=ScalingPolicy(
            min_replicas=settings.planner_decode_min_replicas,
            max_replicas=settings.planner_decode_max_replicas,
            **windows,
        ),
        namespace=settings.planner_namespace,
        budget=WorkerBudget(
            max_workers=settings.planner_max_workers,
            memory_gib=settings.planner_memory_gib or _default_memory_gib(),
            worker_memory_gib=settings.planner_worker_memory_gib,
        ),
        drain_timeout_s=settings.planner_drain_timeout_s,
        paused=settings.planner_paused,
    )


_HOST_MEMORY_SHARE = 0.8
"""Of the host's memory, what the local actuator's workers may take by default (the gateway,
Redis and the OS keep the rest)."""


def _default_memory_gib() -> float | None:
    host = host_memory_gib()
    return None if host is None else host * _HOST_MEMORY_SHARE


def moderation_setup(settings: TandemSettings) -> ModerationSetup:
    """Moderation providers and the default policy as the settings ask."""
    remote = {
        name: RemoteProviderConfig(
            url=provider.url,
            model=provider.model,
            api_key=provider.api_key.get_secret_value() if provider.api_key else None,
            timeout_s=provider.timeout_s,
            on_failure=provider.on_failure,
            threshold=provider.threshold,
        )
        for name, provider in settings.moderation_providers.items()
    }
    policy = settings.moderation_default_policy
    return ModerationSetup(
        rules_path=settings.moderation_rules,
        remote=remote,
        default_policy=ModerationPolicy.from_dict(policy, "TANDEM_MODERATION_DEFAULT_POLICY")
        if policy
        else ModerationPolicy(),
        stream=StreamConfig(
            window_chars=settings.moderation_window_chars,
            overlap_chars=settings.moderation_window_chars,
            batch_chars=settings.moderation_batch_chars,
        ),
    )


def access_config(settings: TandemSettings, model_dir: Path | None) -> AccessConfig:
    """Tenants, quotas and admission as the settings ask."""
    if settings.admin_key is not None:
        admin_key = settings.admin_key.get_secret_value()
    else:
        admin_key, path = load_or_create_admin_key(settings.state_dir)
        log.info("admin API key: in %s (set TANDEM_ADMIN_KEY to choose your own)", path)
    return AccessConfig(
        auth_required=settings.auth_required,
        auth_throttle=AuthThrottleConfig(
            max_failures=settings.auth_failure_limit,
            window_s=settings.auth_failure_window_s,
            trusted_proxies=tuple(settings.trusted_proxies),
        ),
        metrics_public=settings.metrics_public,
        admin_key=admin_key,
        stores=StoreConfig(
            redis_url=settings.redis_url,
            sqlite_path=settings.state_dir / "tandem.db",
            timeout_s=settings.store_timeout_s,
        ),
        controller=ControllerConfig(store_failure=StoreFailurePolicy(settings.quota_store_failure)),
        max_queue=settings.max_queue,
        max_in_flight_per_worker=settings.max_in_flight_per_worker,
        interactive_headroom=settings.interactive_headroom,
        max_band_skips=settings.max_band_skips,
        gate=GateConfig(
            queue_timeout_s=settings.queue_timeout_s, engine_priority=settings.engine_priority
        ),
        tokenizer_dir=model_dir,
    )


def billing_config(settings: TandemSettings, process_index: int = 0) -> BillingConfig | None:
    """The ledger as the settings ask (None when billing is off); ``process_index``: the
    gateway process writing through it, which spools in a directory of its own."""
    if not settings.billing:
        return None
    url = settings.billing_database_url
    return BillingConfig(
        sqlite_path=settings.state_dir / "ledger.db",
        spool_dir=spool_dir(settings.state_dir, process_index),
        database_url=url.get_secret_value() if url is not None else None,
        currency=settings.billing_currency,
        refresh_interval_s=settings.billing_refresh_interval_s,
        worker_micros_per_hour=_micros(settings.worker_cost_per_hour),
        worker_micros_per_hour_by_name=tuple(
            (name, _micros(price)) for name, price in sorted(settings.worker_costs_per_hour.items())
        ),
        telemetry_interval_s=settings.telemetry_interval_s,
    )


def _micros(amount: Decimal) -> int:
    return int((amount * 1_000_000).to_integral_value())


def spool_dir(state_dir: Path, process_index: int) -> Path:
    """Gateway process ``process_index``'s ledger spool: ``ledger-spool`` for ``tandem up``
    itself (as with one process), ``ledger-spool-<i>`` for the others. A writer replays only
    its own directory at start, so two processes never insert one segment at once."""
    return state_dir / ("ledger-spool" if process_index == 0 else f"ledger-spool-{process_index}")
