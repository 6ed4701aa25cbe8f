"""Two gateway replicas on one Redis, for the rollback benchmark: a real ``redis-server``, the
versions of one alias, fake engines, and ``create_app`` gateways served by uvicorn in this process.

Each replica deploys both versions (deployments belong to a gateway process), each on fake
engines of its own, so an engine's arrivals tell which replica routed a request there. The
version registry, policies, rollouts and the rollout lease are in Redis, as with ``tandem up``
and ``TANDEM_REDIS_URL``; each replica runs its own ``RolloutController`` and the two race for
the lease at start, as two gateways starting together do.

The versions are fingerprinted from tiny model folders that differ in their weights' bytes (what
``tandem up`` and ``POST /admin/v1/models`` read: a config, a weights file, a word-level
tokenizer and a chat template), and recorded at start through ``VersionsConfig.register``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers

from bench.overhead.fake_vllm import Timing
from bench.rollouts.engine import Engine
from core.models import GenerationDefaults
from gateway.assembly.app import (
    AccessConfig,
    GatewayConfig,
    RolloutsConfig,
    VersionsConfig,
    create_app,
)
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stores import StoreConfig
from gateway.assembly.supervisor import Supervisor
from gateway.catalog import DeploymentSpec
from gateway.serving.upstream import UpstreamConfig
from rollouts.lease import RedisLease
from versions.manifest import manifest_for
from versions.records import ModelVersion
from workers.deployments import Deployment, Deployments

ALIAS = "bench-rollback"
ADMIN_KEY = "bench-rollback-admin-key"
ENGINE_MODEL = "fake-model"
"""What every fake engine serves (each deployment's ``served_as``)."""
START_TIMEOUT_S = 60.0
"""Generous: on a busy machine importing and starting a gateway can take a while."""

_REPLICA = contextvars.ContextVar("bench_replica", default="?")
"""The replica whose tasks are running (each server task starts with its own value)."""


class NoRedisError(RuntimeError):
    """Neither ``redis-server`` on PATH nor a ``--redis-url``."""


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A ``redis-server`` from PATH on a free port of 127.0.0.1, without persistence; its URL."""
    executable = shutil.which("redis-server")
    if executable is None:
        raise NoRedisError(
            "redis-server is not on PATH: install it (apt-get install redis-server) or pass "
            "--redis-url redis://HOST:PORT/DB (a database of its own: the benchmark leaves its "
            "versions, rollouts and audit entries there)"
        )
    with tempfile.TemporaryDirectory(prefix="tandem-bench-redis-") as folder:
        port = free_port()
        argv = [
            executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", folder, "--logfile", str(Path(folder) / "redis.log"),
        ]  # fmt: skip
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while not _answers_ping(port):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise NoRedisError(f"redis-server did not start on port {port}")
                time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def check_redis(url: str) -> None:
    """``NoRedisError`` unless ``url`` answers PING."""
    try:
        with redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2) as client:
            client.ping()
    except (redis.RedisError, ValueError) as exc:
        raise NoRedisError(f"cannot reach Redis at {url}: {exc}") from exc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def tiny_version(folder: Path, weights: bytes) -> ModelVersion:
    """A version of ``ALIAS`` fingerprinted from a tiny model folder holding ``weights``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "max_position_embeddings": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "hidden_size": 64,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(weights)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a token a word
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    manifest = manifest_for(
        folder, dtype="float32", max_model_len=2048, defaults=GenerationDefaults()
    )
    return ModelVersion.new(
        ALIAS, manifest, source=str(folder), model_dir=str(folder), created_at=time.time(),
        created_by="bench",
    )  # fmt: skip


@dataclass
class Replica:
    """One gateway and the engines its deployments reach."""

    name: str
    base_url: str
    baseline: Engine
    candidate: Engine
    server: uvicorn.Server
    serving: asyncio.Task[None]
    supervisor: Supervisor


@dataclass
class Replicas:
    """What ``replicas`` yields."""

    redis_url: str
    baseline: str
    """The baseline version's name (``alias@8hex``)."""
    candidate: str
    replicas: list[Replica]
    holders: dict[str, str] = field(default_factory=dict)
    """Lease holder name -> replica name, as each controller announced taking the lease."""

    async def lease_holder(self) -> str | None:
        """The replica holding the rollout lease now (None: nobody; ``?``: an unknown one)."""
        lease = RedisLease(self.redis_url)
        try:
            held = await lease.holder()
        finally:
            await lease.aclose()
        return None if held is None else self.holders.get(held[0], "?")


class _HolderNames(logging.Handler):
    """Notes which replica's controller took the lease under which holder name (its log line
    comes from that replica's own task)."""

    def __init__(self, holders: dict[str, str]) -> None:
        super().__init__(logging.INFO)
        self._holders = holders

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("rollouts: %s evaluates them") and record.args:
            holder = record.args[0] if isinstance(record.args, tuple) else None
            self._holders[str(holder)] = _REPLICA.get()


@contextlib.asynccontextmanager
async def replicas(
    redis_url: str,
    *,
    names: tuple[str, ...] = ("A", "B"),
    timing: Timing,
    tick_s: float = 0.25,
    refresh_interval_s: float = 0.5,
) -> AsyncIterator[Replicas]:
    """Gateways ``names`` on ``redis_url`` (an empty database: see the module docstring), each
    with the baseline and the candidate deployed on fake engines of its own; torn down on
    exit. ``tick_s`` and ``refresh_interval_s``: the controller's pass and the policy poll."""
    work = Path(tempfile.mkdtemp(prefix="tandem-bench-rollback-"))
    baseline = await asyncio.to_thread(tiny_version, work / "baseline", b"baseline weights")
    candidate = await asyncio.to_thread(tiny_version, work / "candidate", b"candidate weights")
    found = Replicas(redis_url, baseline.name, candidate.name, [])
    rollouts_log = logging.getLogger("tandem.rollouts")
    handler = _HolderNames(found.holders)
    rollouts_log.addHandler(handler)
    level = rollouts_log.level
    rollouts_log.setLevel(logging.INFO)
    engines: list[Engine] = []
    try:
        for name in names:
            engines += [
                await Engine(f"{name}-baseline", ENGINE_MODEL, timing).start(),
                await Engine(f"{name}-candidate", ENGINE_MODEL, timing).start(),
            ]
        starting = [
            _start_replica(
                name,
                work / name,
                redis_url,
                (baseline, candidate),
                engines[2 * i : 2 * i + 2],
                tick_s,
                refresh_interval_s,
            )
            for i, name in enumerate(names)
        ]
        # Together, as a deployment's gateways start: either may win the lease.
        results = await asyncio.gather(*starting, return_exceptions=True)
        found.replicas += [r for r in results if isinstance(r, Replica)]
        for result in results:
            if isinstance(result, BaseException):
                raise result
        yield found
    finally:
        for replica in found.replicas:
            replica.server.should_exit = True
        for replica in found.replicas:
            with contextlib.suppress(asyncio.CancelledError):
                await replica.serving
            await replica.supervisor.aclose()
        for engine in engines:
            await engine.aclose()
        rollouts_log.removeHandler(handler)
        rollouts_log.setLevel(level)
        shutil.rmtree(work, ignore_errors=True)


async def _start_replica(
    name: str,
    state_dir: Path,
    redis_url: str,
    versions: tuple[ModelVersion, ModelVersion],
    engines: list[Engine],
    tick_s: float,
    refresh_interval_s: float,
) -> Replica:
    settings = TandemSettings(
        state_dir=state_dir,
        cache_dir=state_dir / "cache",
        log_dir=state_dir / "logs",
        health_interval_s=0.5,
        worker_ready_timeout_s=10,
    )
    supervisor = Supervisor(settings)
    deployments: list[Deployment] = []
    for version, engine in zip(versions, engines, strict=True):
        spec = DeploymentSpec(
            num_prefill=0, num_decode=0, decode_urls=(engine.base_url,), served_as=engine.model
        )
        deployment = supervisor.plan(version, spec)
        await supervisor.start(deployment)
        deployments.append(deployment)
    await asyncio.gather(*(pool.wait_ready(10) for pool in supervisor.pools()))
    config = GatewayConfig(
        upstream=UpstreamConfig(
            connect_timeout_s=1, prefill_timeout_s=10, decode_idle_timeout_s=10
        ),
        access=AccessConfig(admin_key=ADMIN_KEY, stores=StoreConfig(redis_url=redis_url)),
        versions=VersionsConfig(register=versions, refresh_interval_s=refresh_interval_s),
        rollouts=RolloutsConfig(tick_s=tick_s, window_bucket_s=1.0),
    )
    app = create_app(config, Deployments(deployments), None, supervisor)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
            lifespan="on",
        )
    )  # fmt: skip
    # The server's tasks, the controller's among them, inherit this replica's name.
    token = _REPLICA.set(name)
    try:
        serving = asyncio.create_task(server.serve(), name=f"bench-gateway-{name}")
    finally:
        _REPLICA.reset(token)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    async with httpx.AsyncClient(base_url=base_url, timeout=2) as client:
        while True:
            if serving.done():
                serving.result()  # raises what stopped it
                raise RuntimeError(f"gateway {name} stopped while starting")
            with contextlib.suppress(httpx.TransportError):
                if (await client.get("/ready")).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway {name} not ready within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.05)
    return Replica(name, base_url, engines[0], engines[1], server, serving, supervisor)
