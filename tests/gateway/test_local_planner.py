"""The planner's local actuator through a real gateway: managed workers (fake engines launched
as processes by the gateway's own supervisor, as ``tandem up`` launches vLLM), scaled up under
streaming load, drained while streams still run on them, and a decode pool at zero brought back
by the first request (which waits with heartbeats instead of failing)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import uvicorn

from billing.cost import CostMeter, WorkerCost
from billing.service import Billing, BillingConfig
from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.app import (
    AccessConfig,
    GatewayConfig,
    RolloutsConfig,
    VersionsConfig,
    _price_added_worker,
    create_app,
)
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stores import StoreConfig
from gateway.assembly.supervisor import LocalVersionBuilder, Supervisor
from gateway.catalog import DeploymentSpec
from gateway.local_actuator import WorkerBudget
from gateway.planning import PlannerConfig
from gateway.serving.upstream import UpstreamConfig
from kv_transfer.decider import DeciderConfig
from planner.profile import DecodePoint, PrefillPoint, Profile
from planner.replicas import Targets
from planner.scaling import ScalingPolicy
from tests.fakes.model_folder import fake_version
from tests.gateway.conftest import ADMIN_KEY, stop_server, wait_until
from tests.server_process import free_port
from workers.deployments import Deployment, Deployments
from workers.registry import Worker

TOKENS = 40
TOKEN_DELAY_S = 0.05
"""Each stream runs ~2 s on a fake worker: long enough to be in flight when a drain starts."""
PROFILE = Profile(
    "fake",
    (PrefillPoint(128, 1000.0), PrefillPoint(2048, 1000.0)),
    # Within the 0.1 s ITL target one worker decodes 6 streams (4.8 at the 0.8 headroom);
    # Little's law at that target counts a ~2 s stream (40 tokens) as 4 s of one.
    (DecodePoint(1, 0.05), DecodePoint(8, 0.12)),
)


@dataclass
class Planned:
    base_url: str
    deployments: Deployments
    supervisor: Supervisor
    client: openai.AsyncOpenAI
    admin: httpx.AsyncClient
    failures: list[str] = field(default_factory=list)
    completed: int = 0

    def decode_workers(self) -> list[Worker]:
        [deployment] = list(self.deployments)
        return list(deployment.decode.workers)

    async def stream(self, content: str = "hello there") -> None:
        """One streamed request; a failure is recorded, never raised."""
        try:
            stream = await self.client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": content}],
                max_tokens=TOKENS,
                stream=True,
            )
            finish = [chunk.choices[0].finish_reason async for chunk in stream if chunk.choices]
            if finish[-1] not in ("length", "stop"):
                raise AssertionError(f"finish reason {finish[-1]!r}")
            self.completed += 1
        except Exception as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")

    async def load(self, clients: int, stop: asyncio.Event) -> None:
        async def client() -> None:
            while not stop.is_set():
                await self.stream()

        await asyncio.gather(*(client() for _ in range(clients)))

    async def metric_shows(self, text: str) -> None:
        """Wait for ``text`` on ``/metrics`` (a drain is counted just after its worker left)."""
        for _ in range(50):
            if text in (await self.admin.get("/metrics")).text:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"/metrics never showed {text!r}")

    async def status(self) -> dict[str, Any]:
        response = await self.admin.get("/admin/v1/planner")
        assert response.status_code == 200, response.text
        return dict(response.json())


@contextlib.asynccontextmanager
async def planned_gateway(
    decode: ScalingPolicy,
    num_decode: int = 1,
    drain_timeout_s: float = 20.0,
    paused: bool = False,
    interval_s: float = 0.3,
) -> AsyncIterator[Planned]:
    """A gateway whose one version starts on ``num_decode`` managed fake decode workers (no
    prefill pool), with the planner in ``local`` mode stepping every ``interval_s``."""
    state_dir = Path(tempfile.mkdtemp(prefix="tandem-planner-"))
    settings = TandemSettings(
        state_dir=state_dir,
        cache_dir=state_dir / "cache",
        log_dir=state_dir / "logs",
        health_interval_s=0.05,
        worker_ready_timeout_s=20,
        decode_base_port=free_port(),
        prefill_base_port=free_port(),
        side_channel_base_port=free_port(),
        worker_command=(
            f"{sys.executable} -m tests.fakes.fake_engine --role both "
            f"--output-tokens {TOKENS} --token-delay-s {TOKEN_DELAY_S}"
        ),
    )
    version = fake_version(state_dir / "models" / "v0", "smol", weights=b"v0")
    supervisor = Supervisor(settings)
    deployment = supervisor.plan(version, DeploymentSpec(num_prefill=0, num_decode=num_decode))
    await supervisor.start(deployment)
    await asyncio.gather(*(pool.wait_ready(20) for pool in supervisor.pools()))
    planner = PlannerConfig(
        mode="local",
        profile=PROFILE,
        interval_s=interval_s,
        targets=Targets(ttft_s=5.0, itl_s=0.1),
        prefill=ScalingPolicy(min_replicas=0, max_replicas=0),
        decode=decode,
        budget=WorkerBudget(max_workers=3),
        drain_timeout_s=drain_timeout_s,
        paused=paused,
    )
    config = GatewayConfig(
        upstream=UpstreamConfig(connect_timeout_s=1, prefill_timeout_s=5, decode_idle_timeout_s=5),
        sse_ping_interval_s=0.2,
        decider=DeciderConfig(min_prompt_tokens=0),
        access=AccessConfig(
            admin_key=ADMIN_KEY,
            auth_required=False,
            stores=StoreConfig(sqlite_path=state_dir / "tandem.db"),
            max_in_flight_per_worker=8,
        ),
        billing=None,
        versions=VersionsConfig(register=(version,), refresh_interval_s=0.1),
        # The planner's load comes from these windows: buckets of a few of its steps.
        rollouts=RolloutsConfig(enabled=False, window_bucket_s=0.5),
        planner=planner,
    )
    deployments = Deployments([deployment])
    app = create_app(
        config, deployments, LocalVersionBuilder(settings), supervisor, launcher=supervisor
    )
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    serving = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started, timeout_s=20)
    base_url = f"http://127.0.0.1:{port}"
    admin = httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30
    )
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="anonymous", max_retries=0, timeout=60
    )
    try:
        yield Planned(base_url, deployments, supervisor, client, admin)
    finally:
        await client.close()
        await admin.aclose()
        await stop_server(server, serving)
        await supervisor.aclose()
        shutil.rmtree(state_dir, ignore_errors=True)


async def test_streams_scale_decode_up_and_a_drain_under_load_fails_none() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, down_window_s=4, cooldown_s=1)
    # Steps as long as a stream: a rate read over less swings with each stream that ends.
    async with planned_gateway(policy, interval_s=2.0) as stack:
        stop = asyncio.Event()
        heavy = asyncio.create_task(stack.load(12, stop))
        # Twelve clients need five workers by the profile: the planner asks for its maximum,
        # 2, and the actuator launches decode-1, which serves once healthy.
        await wait_until(
            lambda: sum(w.in_rotation for w in stack.decode_workers()) == 2, timeout_s=30
        )
        [added] = [w for w in stack.decode_workers() if w.name != "decode-0"]
        await wait_until(lambda: added.num_outstanding > 0, timeout_s=10)

        # Down to two clients, one stream on each worker: one worker is enough. The drained
        # worker still has its stream in flight when it leaves rotation; it finishes there.
        stop.set()
        await heavy
        stop = asyncio.Event()
        light = asyncio.create_task(stack.load(2, stop))
        seen_busy_draining: list[str] = []

        def drained_to_one() -> bool:
            for worker in stack.decode_workers():
                if worker.draining and worker.num_outstanding:
                    seen_busy_draining.append(worker.name)
            return len(stack.decode_workers()) == 1

        await wait_until(drained_to_one, timeout_s=30)
        stop.set()
        await light

        assert stack.failures == []
        assert stack.completed >= 6
        assert seen_busy_draining, "no worker was draining with streams in flight"
        status = await stack.status()
        [version] = status["versions"]
        changes = [(d["current"], d["desired"]) for d in version["pools"]["decode"]["decisions"]]
        assert (1, 2) in changes and (2, 1) in changes, changes
        await stack.metric_shows('tandem_planner_drains_total{outcome="clean",pool="decode"')


async def test_streams_still_running_at_the_drain_deadline_end_with_an_error_event() -> None:
    policy = ScalingPolicy(min_replicas=1, max_replicas=2, down_window_s=0, cooldown_s=0)
    async with planned_gateway(policy, num_decode=2, drain_timeout_s=0.5, paused=True) as stack:
        # One stream on each worker (least-loaded picking), then the planner may act: no load
        # needs one worker, and the one it drains is still streaming at its 0.5 s deadline.
        streams = [asyncio.create_task(stack.stream()) for _ in range(2)]
        await wait_until(
            lambda: all(w.num_outstanding == 1 for w in stack.decode_workers()), timeout_s=10
        )
        pids = {s.name: s.pid for pool in stack.supervisor.pools() for s in pool.status()}
        resumed = await stack.admin.post("/admin/v1/planner/resume", json={"reason": "test"})
        assert resumed.status_code == 200, resumed.text
        await asyncio.gather(*streams)
        await wait_until(lambda: len(stack.decode_workers()) == 1, timeout_s=10)

        # The client of the cut stream got the gateway's error event (the SDK raises it as an
        # APIError), not a broken connection; the other stream completed.
        assert stack.completed == 1
        [failure] = stack.failures
        assert failure.startswith("APIError"), failure
        [kept] = stack.decode_workers()
        [gone] = [name for name in pids if name != kept.name]
        assert not psutil.pid_exists(pids[gone]) or (
            psutil.Process(pids[gone]).status() == psutil.STATUS_ZOMBIE
        )
        await stack.metric_shows('tandem_planner_drains_total{outcome="deadline",pool="decode"')


async def test_a_decode_pool_at_zero_is_brought_back_by_the_first_request() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, down_window_s=0.5, cooldown_s=0)
    async with planned_gateway(policy) as stack:
        # No traffic: the planner drains the one worker (Dynamo's planner cannot reach zero).
        await wait_until(lambda: not stack.decode_workers(), timeout_s=15)
        ready = await stack.admin.get("/ready")
        assert ready.status_code == 200, ready.text  # a pool at zero is not a gateway down

        # The first request finds no decode worker, wakes the planner, and waits in the
        # queue (heartbeats on its stream) while a worker boots; then it is served.
        await stack.stream()
        assert stack.failures == []
        assert stack.completed == 1
        status = await stack.status()
        [version] = status["versions"]
        changes = [(d["current"], d["desired"]) for d in version["pools"]["decode"]["decisions"]]
        # Oldest last: to zero, back to one for the request (and, idle again, maybe to zero).
        assert changes[-2:] == [(0, 1), (1, 0)], changes


async def test_paused_the_planner_reports_and_changes_nothing() -> None:
    policy = ScalingPolicy(min_replicas=0, max_replicas=1, down_window_s=0, cooldown_s=0)
    async with planned_gateway(policy, paused=True) as stack:
        await asyncio.sleep(1.5)  # five steps that want the idle pool at zero
        assert [w.in_rotation for w in stack.decode_workers()] == [True]
        status = await stack.status()
        assert status["paused"] is True
        [version] = status["versions"]
        assert version["pools"]["decode"]["desired"] == 0
        # The pause is audited once, a malformed one refused with the field named.
        refused = await stack.admin.post("/admin/v1/planner/resume", json={"reason": 5})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "reason"
        assert (await stack.status())["paused"] is True
        for _ in range(2):  # the second changes nothing and is not audited
            resumed = await stack.admin.post("/admin/v1/planner/resume", json={"reason": "go"})
            assert resumed.status_code == 200 and resumed.json()["paused"] is False
        audit = (await stack.admin.get("/admin/v1/audit")).json()["data"]
        held = [(e["action"], e["reason"]) for e in audit if e["subject"] == "planner"]
        assert held == [("planner.resume", "go")]
        assert all(e["actor"].startswith("admin-") for e in audit if e["subject"] == "planner")


def test_the_gateway_prices_a_planner_worker_like_its_pool_or_as_configured(
    tmp_path: Path,
) -> None:
    class Pool:
        workers: list[Worker] = []
        kv_watermark = 1.0

        def pick(self) -> None:
            return None

    model = ServedModel("smol", 256, 0, "smol@1", "smol")
    deployments = Deployments([Deployment(model, Pool(), Pool())])
    meter = CostMeter([WorkerCost("decode-0", "smol", "smol@1", 5_000_000)])
    config = BillingConfig(
        sqlite_path=tmp_path / "ledger.db", spool_dir=tmp_path / "spool", worker_micros_per_hour=7
    )
    billing = Billing(config, cost_meter=meter)
    new = Worker("decode-1", WorkerRole.DECODE, "http://w")
    _price_added_worker(billing, deployments, "smol@1", new, "decode-0")
    assert meter.price_of("decode-1") == WorkerCost("decode-1", "smol", "smol@1", 5_000_000)
    alone = Worker("decode-2", WorkerRole.DECODE, "http://w")
    _price_added_worker(billing, deployments, "smol@1", alone, None)
    assert meter.price_of("decode-2") == config.worker_cost("decode-2", "smol", "smol@1")
