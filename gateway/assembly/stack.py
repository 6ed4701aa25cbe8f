"""Assembling a whole stack from settings: the model, both worker pools, the gateway app.

``tandem up`` and the end-to-end tests build the stack the same way, through ``Stack``.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path

from fastapi import FastAPI

from admission.controller import ControllerConfig, StoreFailurePolicy
from billing.service import BillingConfig
from core.messages import WorkerRole
from core.models import ServedModel
from core.moderation import ModerationPolicy
from decode_pool import DecodePool, decode_worker_specs
from gateway.assembly.admin_key import load_or_create_admin_key
from gateway.assembly.app import AccessConfig, GatewayConfig, create_app
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stores import StoreConfig
from gateway.serving.content_policy import ModerationSetup
from gateway.serving.deadlines import DeadlineConfig
from gateway.serving.gate import GateConfig
from gateway.serving.idempotent import IdempotencyConfig
from gateway.serving.upstream import UpstreamConfig
from kv_transfer.connector import ConnectorConfig
from kv_transfer.decider import DeciderConfig
from kv_transfer.geometry import KvGeometry
from moderation.remote import RemoteProviderConfig
from moderation.stream import StreamConfig
from prefill_pool import PrefillPool, prefill_worker_specs
from workers.model import ModelPreparationError, PreparedModel, find_prepared
from workers.pool import PoolConfig, WorkerPool
from workers.process import LaunchConfig, WorkerSpec

log = logging.getLogger("tandem.gateway")


def prepare_model_in_subprocess(source: Path | None, cache_dir: Path | None) -> PreparedModel:
    """Prepare the model in a child process, then read the verified result here.

    Conversion imports torch and transformers (~1 GB resident); doing it in a child keeps the
    gateway process lean. A prepared model is found instantly without starting the child.
    """
    prepared = find_prepared(source, cache_dir=cache_dir)
    if prepared is not None:
        return prepared
    argv = [sys.executable, "-m", "workers.model"]
    if source is not None:
        argv += ["--model", str(source)]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    if subprocess.run(argv, check=False).returncode != 0:
        raise ModelPreparationError("model preparation failed; see the messages above")
    prepared = find_prepared(source, cache_dir=cache_dir)
    if prepared is None:
        raise ModelPreparationError("model preparation finished but left no complete folder")
    return prepared


def _pool_config(
    settings: TandemSettings,
    role: WorkerRole,
    specs: tuple[WorkerSpec, ...],
    external_urls: list[str],
) -> PoolConfig:
    return PoolConfig(
        role=role,
        specs=specs,
        external_urls=tuple(external_urls),
        log_dir=settings.log_dir,
        health_interval_s=settings.health_interval_s,
        ready_timeout_s=settings.worker_ready_timeout_s,
        # Both pools get it; only decode workers' usage is read (KvUsageWatcher), so only
        # they are ever KV-full: admission capacity and decode picking share this one value.
        kv_watermark=settings.kv_usage_watermark,
    )


@dataclass(slots=True)
class Stack:
    """Both pools and the app over them. ``start()`` boots workers; ``aclose()`` stops them."""

    settings: TandemSettings
    prefill: WorkerPool
    decode: WorkerPool
    model: ServedModel
    model_dir: Path | None = None
    """The prepared model folder (its tokenizer counts prompt tokens); None for external-only."""

    @classmethod
    def from_settings(cls, settings: TandemSettings, prepared: PreparedModel | None) -> Stack:
        """Pools for ``settings``; ``prepared`` is required when any worker is managed."""
        num_managed = settings.num_prefill_workers + settings.num_decode_workers
        if prepared is None and num_managed:
            raise ValueError("managed workers need a prepared model")
        name = settings.served_model_name or (prepared.served_name if prepared else None)
        if name is None:
            raise ValueError(
                "set TANDEM_SERVED_MODEL_NAME (or --served-model-name) to the model name the "
                "external workers serve"
            )
        max_len = settings.max_model_len or (prepared.max_model_len if prepared else None)
        launch = LaunchConfig(
            model_path=prepared.path if prepared else Path("."),
            served_model_name=name,
            host=settings.worker_host,
            max_model_len=settings.max_model_len,
            kv_cache_gib=settings.kv_cache_gib,
            block_size=settings.kv_block_size,
            enforce_eager=settings.enforce_eager,
            dtype=settings.dtype,
            scheduling_policy="priority" if settings.engine_priority else "fcfs",
            connector=connector_config(settings),
            extra_args=tuple(shlex.split(settings.worker_extra_args)),
        )
        num_prefill = settings.num_prefill_workers
        binds: tuple[str | None, ...] = tuple(settings.cpu_binding)
        prefill = PrefillPool(
            _pool_config(
                settings,
                WorkerRole.PREFILL,
                prefill_worker_specs(
                    launch,
                    num_workers=num_prefill,
                    base_port=settings.prefill_base_port,
                    base_side_channel_port=settings.side_channel_base_port,
                    cpu_binds=binds[:num_prefill],
                ),
                settings.prefill_urls,
            )
        )
        decode = DecodePool(
            _pool_config(
                settings,
                WorkerRole.DECODE,
                decode_worker_specs(
                    replace(launch, max_num_batched_tokens=settings.decode_step_tokens or None),
                    num_workers=settings.num_decode_workers,
                    base_port=settings.decode_base_port,
                    # Side channels of all workers on a host must differ: decode ones follow.
                    base_side_channel_port=settings.side_channel_base_port + num_prefill,
                    cpu_binds=binds[num_prefill:],
                ),
                settings.decode_urls,
            )
        )
        version = settings.model_version or (prepared.path.name if prepared else name)
        geometry = (
            KvGeometry.of_model_dir(
                prepared.path, dtype=settings.dtype, block_size=settings.kv_block_size
            )
            if prepared
            else None
        )
        model = ServedModel(
            name,
            max_len,
            int(time.time()),
            version,
            settings.deployment,
            default_max_tokens=settings.default_max_tokens or None,
            kv_block_bytes=None if geometry is None else geometry.bytes_per_block,
        )
        return cls(settings, prefill, decode, model, prepared.path if prepared else None)

    async def start(self, on_progress: Callable[[str], None] | None = None) -> None:
        """Launch every managed worker and wait until all workers are healthy."""
        await asyncio.gather(self.prefill.start(), self.decode.start())
        timeout_s = self.settings.worker_ready_timeout_s

        def report(role: WorkerRole) -> Callable[[str], None] | None:
            if on_progress is None:
                return None
            return lambda line: on_progress(f"{role.value}: {line}")

        await asyncio.gather(
            self.prefill.wait_ready(timeout_s, report(WorkerRole.PREFILL)),
            self.decode.wait_ready(timeout_s, report(WorkerRole.DECODE)),
        )

    async def aclose(self) -> None:
        """Stop both pools; no worker process is left behind."""
        await asyncio.gather(self.prefill.aclose(), self.decode.aclose())

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
            billing=billing_config(settings),
        )
        return create_app(config, self.prefill, self.decode, [self.model])


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
        ),
    )


def connector_config(settings: TandemSettings) -> ConnectorConfig:
    """The KV connector of every worker, which the gateway honours too (its KV lease)."""
    return ConnectorConfig(
        kv_lease_s=settings.kv_lease_s, progress_delay_us=settings.nixl_progress_delay_us
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


def billing_config(settings: TandemSettings) -> BillingConfig | None:
    """The ledger as the settings ask (None when billing is off)."""
    if not settings.billing:
        return None
    url = settings.billing_database_url
    return BillingConfig(
        sqlite_path=settings.state_dir / "ledger.db",
        spool_dir=settings.state_dir / "ledger-spool",
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
