"""Versions onto workers: fingerprinting a model source, and launching a version's pools.

``LocalVersionBuilder`` prepares a source (a GGUF converted once into the model cache, in a
child process) and reads its manifest into a ``ModelVersion``. ``Supervisor`` gives each
deployed version pools of its own: managed workers serve the version's name
(``--served-model-name alias@8hex``) on ports counted up across every deployment of this
gateway; external workers are health-polled. The first deployment keeps the one-version
names (``prefill-0``, ``decode-0``); later ones are prefixed with their id (``3f2a9c1d-decode-0``).
"""

from __future__ import annotations

import asyncio
import shlex
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

from core.messages import WorkerRole
from core.models import GenerationDefaults, ServedModel
from decode_pool import DecodePool, decode_worker_specs
from gateway.assembly.settings import TandemSettings
from gateway.catalog import DeployError, DeploymentSpec
from kv_transfer.connector import ConnectorConfig
from kv_transfer.geometry import KvGeometry
from prefill_pool import PrefillPool, prefill_worker_specs
from telemetry.tracing import TracingConfig
from versions.manifest import manifest_for, output_affecting_args
from versions.records import ModelVersion, VersionSourceError, check_alias
from workers.deployments import Deployment, DeploymentExistsError
from workers.model import BUNDLED_SOURCE, ModelPreparationError, prepare_in_subprocess
from workers.pool import Drained, PoolConfig, WorkerPool, WorkerStartupError
from workers.process import LaunchConfig, WorkerProcess, WorkerSpec
from workers.registry import Worker


def connector_config(settings: TandemSettings) -> ConnectorConfig:
    """The KV connector of every worker, which the gateway honours too (its KV lease)."""
    return ConnectorConfig(
        kv_lease_s=settings.kv_lease_s,
        progress_delay_us=settings.nixl_progress_delay_us,
        thread_nice=settings.nixl_thread_nice,
        ucx_transports=settings.ucx_transports,
    )


def fingerprint(
    settings: TandemSettings,
    source: Path | None,
    alias: str | None,
    *,
    dtype: str | None = None,
    defaults: GenerationDefaults | None = None,
    engine_args: tuple[str, ...] = (),
    note: str = "",
    actor: str = "config",
) -> ModelVersion:
    """Prepare ``source`` (None: the bundled model) and record what it is as a version of
    ``alias`` (None: the name derived from the source). Blocking: run it in a thread."""
    try:
        prepared = prepare_in_subprocess(source, settings.cache_dir)
    except ModelPreparationError as exc:
        raise VersionSourceError(str(exc)) from exc
    except OSError as exc:  # unreadable: permissions, a vanished file
        raise VersionSourceError(f"cannot read {exc.filename or source}: {exc.strerror}") from exc
    alias = check_alias(alias or settings.served_model_name or prepared.served_name)
    dtype = dtype or settings.dtype
    manifest = manifest_for(
        prepared.path,
        dtype=dtype,
        max_model_len=settings.max_model_len or prepared.max_model_len,
        engine_args=(*shlex.split(settings.worker_extra_args), *engine_args),
        defaults=defaults or GenerationDefaults(),
    )
    return ModelVersion.new(
        alias,
        manifest,
        source=BUNDLED_SOURCE if source is None else str(source),
        model_dir=str(prepared.path),
        created_at=time.time(),
        created_by=actor,
        note=note,
    )


class LocalVersionBuilder:
    """``VersionBuilder`` on this host: sources are paths the gateway can read."""

    def __init__(self, settings: TandemSettings) -> None:
        self._settings = settings

    async def build(
        self,
        source: str,
        alias: str,
        *,
        dtype: str | None,
        defaults: GenerationDefaults,
        engine_args: tuple[str, ...],
        note: str,
        actor: str,
    ) -> ModelVersion:
        path = None if source == BUNDLED_SOURCE else Path(source)
        return await asyncio.to_thread(
            fingerprint,
            self._settings,
            path,
            alias,
            dtype=dtype,
            defaults=defaults,
            engine_args=engine_args,
            note=note,
            actor=actor,
        )


def served_model(
    settings: TandemSettings, version: ModelVersion, served_as: str | None = None
) -> ServedModel:
    """What the gateway serves for ``version``."""
    manifest = version.manifest
    geometry = KvGeometry.of_model_dir(
        Path(version.model_dir), dtype=manifest.dtype, block_size=settings.kv_block_size
    )
    return ServedModel(
        version.alias,
        manifest.max_model_len,
        int(version.created_at),
        version.name,
        settings.deployment,
        default_max_tokens=manifest.defaults.max_tokens or settings.default_max_tokens or None,
        kv_block_bytes=None if geometry is None else geometry.bytes_per_block,
        tokenizer_dir=Path(version.model_dir),
        served_as=served_as,
        defaults=manifest.defaults,
    )


class Supervisor:
    """Launches and stops versions' pools (``gateway.catalog.Deployer``)."""

    def __init__(self, settings: TandemSettings, tracing: TracingConfig | None = None) -> None:
        """``tracing``: where the workers export their spans (the gateway's own endpoint)."""
        self._settings = settings
        self._tracing = tracing or TracingConfig()
        self._next_port = {
            "prefill": settings.prefill_base_port,
            "decode": settings.decode_base_port,
            "side_channel": settings.side_channel_base_port,
        }
        self._taken: set[int] = set()
        self._num_deployed = 0
        self._binds: dict[str, dict[str, str | None]] = {}
        """Per deployed version, the cores each of its managed workers is pinned to."""
        self._pools: dict[str, tuple[WorkerPool, WorkerPool]] = {}
        self._launches: dict[str, _Launches] = {}
        """How each version with managed workers launches more of them."""

    def plan(self, version: ModelVersion | None, spec: DeploymentSpec) -> Deployment:
        """The deployment's pools, not started; ``version`` None: external workers only, under
        the settings' model name (nothing to fingerprint)."""
        settings = self._settings
        first = self._num_deployed == 0
        prefix = "" if first or version is None else f"{version.version_id[:8]}-"
        if version is None:
            name = settings.served_model_name
            if name is None:
                raise DeployError(
                    "set TANDEM_SERVED_MODEL_NAME (or --served-model-name) to the model name "
                    "the external workers serve"
                )
            model = ServedModel(
                name,
                settings.max_model_len,
                int(time.time()),
                settings.model_version,
                settings.deployment,
                default_max_tokens=settings.default_max_tokens or None,
            )
            launch = None
        else:
            model = served_model(settings, version, spec.served_as)
            launch = self._launch_config(version, model, spec.engine_args)
        if model.version_name in self._pools:
            raise DeploymentExistsError(f"{model.version_name} is already deployed")
        binds = self._cpu_binds(first, spec.num_prefill + spec.num_decode)
        prefill_specs: tuple[WorkerSpec, ...] = ()
        decode_specs: tuple[WorkerSpec, ...] = ()
        if launch is not None:
            decode_launch = replace(
                launch, max_num_batched_tokens=settings.decode_step_tokens or None
            )
            prefill_specs = self._with_ports(
                prefill_worker_specs(
                    launch, num_workers=spec.num_prefill, cpu_binds=binds[: spec.num_prefill]
                ),
                prefix,
            )
            decode_specs = self._with_ports(
                decode_worker_specs(
                    decode_launch,
                    num_workers=spec.num_decode,
                    cpu_binds=binds[spec.num_prefill :],
                ),
                prefix,
            )
            if spec.num_prefill + spec.num_decode:  # external-only: someone else's to size
                self._launches[model.version_name] = _Launches(
                    {WorkerRole.PREFILL: launch, WorkerRole.DECODE: decode_launch},
                    prefix,
                    {WorkerRole.PREFILL: spec.num_prefill, WorkerRole.DECODE: spec.num_decode},
                )
        self._binds[model.version_name] = {
            worker.name: worker.cpu_bind for worker in (*prefill_specs, *decode_specs)
        }
        prefill = PrefillPool(
            self._pool_config(WorkerRole.PREFILL, prefill_specs, spec.prefill_urls, prefix)
        )
        decode = DecodePool(
            self._pool_config(WorkerRole.DECODE, decode_specs, spec.decode_urls, prefix)
        )
        self._num_deployed += 1
        self._pools[model.version_name] = (prefill, decode)
        return Deployment(model, prefill, decode)

    def _cpu_binds(self, first: bool, num_workers: int) -> tuple[str | None, ...]:
        """The OpenMP binding of each of a deployment's managed workers (prefill ones first).
        The first deployment takes ``cpu_binding`` as configured (workers past its end are not
        pinned); a later one's workers each take the entry fewest deployed workers are pinned
        to (the first such in ``cpu_binding``): on a small host a candidate then shares the
        idler core, not the one a loaded worker of the first version already runs on. Pinned,
        each worker runs its model thread on its own cores; unpinned, OpenMP spreads it over
        every core, where it waits on threads the other workers keep busy."""
        cycle = self._settings.cpu_binding
        if first or not cycle:
            return tuple(cycle)
        load = {bind: 0 for bind in cycle}
        for binds in self._binds.values():
            for bind in binds.values():
                if bind in load:
                    load[bind] += 1
        chosen: list[str | None] = []
        for _ in range(num_workers):
            bind = min(cycle, key=lambda b: load[b])  # min keeps the first of equals
            load[bind] += 1
            chosen.append(bind)
        return tuple(chosen)

    async def start(self, deployment: Deployment) -> None:
        """Launch its managed workers (returns at once; ``wait_ready`` waits)."""
        prefill, decode = self._pools[deployment.version]
        await asyncio.gather(prefill.start(), decode.start())

    async def deploy(self, version: ModelVersion, spec: DeploymentSpec) -> Deployment:
        """Plan, launch and wait for a version's workers (the admin API's deployments)."""
        deployment = self.plan(version, spec)
        prefill, decode = self._pools[deployment.version]
        try:
            await self.start(deployment)
            timeout_s = self._settings.worker_ready_timeout_s
            await asyncio.gather(prefill.wait_ready(timeout_s), decode.wait_ready(timeout_s))
        except WorkerStartupError as exc:
            await self.undeploy(deployment)
            raise DeployError(f"{version.name} did not start: {exc}") from exc
        return deployment

    async def undeploy(self, deployment: Deployment) -> None:
        """Stop its managed workers."""
        pools = self._pools.pop(deployment.version, None)
        self._binds.pop(deployment.version, None)
        self._launches.pop(deployment.version, None)
        if pools is not None:
            await asyncio.gather(*(pool.aclose() for pool in pools))
            for pool in pools:
                for status in pool.status():
                    self._give_back_ports(pool.process(status.name))

    def can_add(self, version: str) -> bool:
        """Whether ``version``'s pools can be given more workers here (it has managed ones:
        external workers are someone else's to start)."""
        return version in self._launches and version in self._pools

    def managed(self, version: str, role: WorkerRole) -> set[str]:
        """Names of the managed workers of ``version``'s ``role`` pool."""
        pool = self._pool(version, role)
        if pool is None:
            return set()
        return {status.name for status in pool.status() if status.managed}

    def num_managed(self) -> int:
        """Managed worker processes of every deployment, draining ones included (what the
        host runs now)."""
        return sum(1 for pool in self.pools() for status in pool.status() if status.managed)

    async def add_worker(self, version: str, role: WorkerRole) -> Worker:
        """Launch one more worker in ``version``'s ``role`` pool (it serves once healthy)."""
        launches = self._launches.get(version)
        pool = self._pool(version, role)
        if launches is None or pool is None:
            raise DeployError(f"{version} has no managed workers here to add to")
        index = launches.next_index[role]
        launches.next_index[role] = index + 1
        bind = next(iter(self._cpu_binds(False, 1)), None)
        spec = WorkerSpec(
            name=f"{launches.prefix}{role.value}-{index}",
            role=role,
            port=self._take(role.value),
            side_channel_port=self._take("side_channel"),
            launch=launches.launch[role],
            cpu_bind=bind,
        )
        try:
            worker = await pool.add(spec)
        except BaseException:
            self._give_back(spec)
            raise
        self._binds[version][spec.name] = bind
        return worker

    async def drain_worker(
        self, version: str, role: WorkerRole, name: str, timeout_s: float
    ) -> Drained:
        """Drain managed worker ``name`` of ``version`` (``WorkerPool.drain``) and give its
        ports and core binding back."""
        pool = self._pool(version, role)
        if pool is None:
            raise DeployError(f"{version} is not deployed here")
        process = pool.process(name)
        drained = await pool.drain(name, timeout_s)
        self._binds.get(version, {}).pop(name, None)
        self._give_back_ports(process)
        return drained

    def _pool(self, version: str, role: WorkerRole) -> WorkerPool | None:
        """``version``'s pool of ``role``; None when it is not deployed here."""
        pools = self._pools.get(version)
        if pools is None:
            return None
        return pools[0] if role is WorkerRole.PREFILL else pools[1]

    def _give_back_ports(self, process: WorkerProcess | None) -> None:
        if process is not None:
            self._give_back(process.spec)

    def _give_back(self, spec: WorkerSpec) -> None:
        for kind, port in ((spec.role.value, spec.port), ("side_channel", spec.side_channel_port)):
            self._taken.discard(port)
            self._next_port[kind] = min(self._next_port[kind], port)

    async def aclose(self) -> None:
        """Stop every pool this supervisor started; no worker process is left behind."""
        pools = [pool for pair in self._pools.values() for pool in pair]
        self._pools.clear()
        await asyncio.gather(*(pool.aclose() for pool in pools))

    def pools(self) -> list[WorkerPool]:
        """Every pool, in deployment order (prefill then decode)."""
        return [pool for pair in self._pools.values() for pool in pair]

    def _with_ports(self, specs: tuple[WorkerSpec, ...], prefix: str) -> tuple[WorkerSpec, ...]:
        """``specs`` named with ``prefix``, each on the next free HTTP and side-channel port:
        ports count up from the settings' bases across every deployment (from the lowest a
        stopped worker gave back), skipping any port another worker of this gateway (of any
        kind) or another process holds."""
        return tuple(
            replace(
                spec,
                name=prefix + spec.name,
                port=self._take(spec.role.value),
                side_channel_port=self._take("side_channel"),
            )
            for spec in specs
        )

    def _take(self, kind: str) -> int:
        port = self._next_port[kind]
        while port in self._taken or not port_is_free(self._settings.worker_host, port):
            port += 1
        self._taken.add(port)
        self._next_port[kind] = port + 1
        return port

    def _launch_config(
        self, version: ModelVersion, model: ServedModel, deployment_args: tuple[str, ...]
    ) -> LaunchConfig:
        settings = self._settings
        return LaunchConfig(
            model_path=Path(version.model_dir),
            served_model_name=model.engine_name,
            host=settings.worker_host,
            max_model_len=settings.max_model_len,
            kv_cache_gib=settings.kv_cache_gib,
            busy_wait_pause_us=settings.worker_busy_wait_pause_us,
            block_size=settings.kv_block_size,
            enforce_eager=settings.enforce_eager,
            dtype=version.manifest.dtype,
            scheduling_policy="priority" if settings.engine_priority else "fcfs",
            connector=connector_config(settings),
            otlp_traces_endpoint=self._tracing.traces_endpoint,
            otlp_traces_protocol=self._tracing.protocol,
            command=tuple(shlex.split(settings.worker_command)) or None,
            extra_args=(
                *shlex.split(settings.worker_extra_args),
                *_version_args(version, settings.worker_extra_args),
                *deployment_args,
            ),
        )

    def _pool_config(
        self,
        role: WorkerRole,
        specs: tuple[WorkerSpec, ...],
        external_urls: tuple[str, ...] | list[str],
        prefix: str,
    ) -> PoolConfig:
        settings = self._settings
        return PoolConfig(
            role=role,
            specs=specs,
            external_urls=tuple(external_urls),
            name_prefix=prefix,
            log_dir=settings.log_dir,
            health_interval_s=settings.health_interval_s,
            ready_timeout_s=settings.worker_ready_timeout_s,
            # Both pools get it; only decode workers' usage is read (KvUsageWatcher), so only
            # they are ever KV-full: admission capacity and decode picking share this one value.
            kv_watermark=settings.kv_usage_watermark,
        )


@dataclass(slots=True)
class _Launches:
    """How a version's managed workers are launched, to add more at runtime."""

    launch: dict[WorkerRole, LaunchConfig]
    prefix: str
    """Before each worker's name (empty for the first deployment)."""
    next_index: dict[WorkerRole, int]
    """The number the pool's next worker is named with (never reused: a name is a log file)."""


def _version_args(version: ModelVersion, gateway_wide: str) -> tuple[str, ...]:
    """The version's own engine flags: its manifest's, less those every worker gets anyway
    (``TANDEM_WORKER_EXTRA_ARGS``, fingerprinted into every version)."""
    common = set(output_affecting_args(shlex.split(gateway_wide)))
    own = [arg for arg in version.manifest.engine_args if arg not in common]
    return tuple(part for arg in own for part in arg.split("=", 1))


def port_is_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` now (the gateway's and workers' ports are
    checked before a boot of minutes, not found taken at its end)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
