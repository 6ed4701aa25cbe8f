"""The planner's loop in the gateway, on its own: steps over the deployed versions, what a
failing step leaves (a count, and the loop going on), a change recorded once until the pool
reaches it, an undeployed version forgotten, the lease; and the planner refused at start
without a worker profile."""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import planner_config
from gateway.cli.main import main
from gateway.metrics import GatewayMetrics
from gateway.planning import LEASE_NAME, GatewayPlanner, PlannerConfig, dry_run_actuator
from planner.actuate import DryRunActuator
from planner.controller import LoadUnavailable
from planner.profile import DecodePoint, PrefillPoint, Profile, ProfileError
from planner.replicas import Load, Observed
from rollouts.lease import SqliteLease
from tests.gateway.conftest import wait_until
from versions.store_sqlite import SqliteVersionStore
from workers.deployments import Deployment, Deployments
from workers.registry import Worker

V1 = "smol@11111111"
# Per worker: 1000 prompt tokens/s; 2 streams within the 0.1 s ITL target (x 0.8 headroom).
PROFILE = Profile(
    V1,
    prefill=(PrefillPoint(128, 1000.0),),
    decode=(DecodePoint(1, 0.05), DecodePoint(4, 0.2)),
)
LOAD = Load(request_rate=10, input_tokens=128, output_tokens=10)
"""Needs 2 prefill workers (1280 tokens/s) and 7 decode workers (10 streams)."""


class Script:
    """The loads a planner reads, one per step (an exception is raised), then ``then``."""

    def __init__(self, *steps: Load | Exception, then: Load = LOAD) -> None:
        self._steps = list(steps)
        self._then = then

    async def interval(self, version: str, window_s: float) -> tuple[Load, Observed]:
        step = self._steps.pop(0) if self._steps else self._then
        if isinstance(step, Exception):
            raise step
        return step, Observed()


@dataclass
class Pool:
    """A pool of ``role`` whose workers a test sets (``resize``)."""

    role: WorkerRole
    workers: list[Worker] = field(default_factory=list)
    kv_watermark: float = 1.0

    def pick(self) -> Worker | None:
        return None

    def resize(self, healthy: int, booting: int = 0) -> None:
        names = [f"{self.role.value}-{i}" for i in range(healthy + booting)]
        self.workers = [
            Worker(name, self.role, f"http://{name}", healthy=i < healthy)
            for i, name in enumerate(names)
        ]


def _pools(prefill: int, decode: int, decode_booting: int = 0) -> tuple[Pool, Pool]:
    pools = Pool(WorkerRole.PREFILL), Pool(WorkerRole.DECODE)
    pools[0].resize(prefill)
    pools[1].resize(decode, decode_booting)
    return pools


def _deployed(prefill: Pool, decode: Pool) -> Deployments:
    return Deployments([Deployment(ServedModel("smol", 256, 0, V1), prefill, decode)])


def _sample(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def _config(interval_s: float = 1.0, mode: str = "dry-run") -> PlannerConfig:
    return PlannerConfig(mode=mode, profile=PROFILE, interval_s=interval_s)  # type: ignore[arg-type]


async def test_a_failing_step_is_counted_and_the_loop_goes_on() -> None:
    prefill, decode = _pools(1, 1)
    deployments = _deployed(prefill, decode)
    metrics = GatewayMetrics([])
    # 1000 requests/s: at 0.01 s an interval, still ten requests a step (less is no traffic).
    source = Script(
        LoadUnavailable("the windows are empty"), RuntimeError("a bug"), then=Load(1000, 128, 10)
    )
    planner = GatewayPlanner(
        _config(interval_s=0.01), deployments, source, dry_run_actuator(deployments), metrics,
        audit_store=None,
    )  # fmt: skip
    await planner.start()
    try:
        await wait_until(
            lambda: (
                _sample(metrics, "tandem_planner_desired_replicas", version=V1, pool="decode") == 8
            )  # the most a decode pool may have
        )
    finally:
        await planner.aclose()
    assert _sample(metrics, "tandem_planner_step_errors_total", version=V1) == 2
    [version] = planner.status()["versions"]
    assert version["error"] is None  # cleared by the steps that went through


async def test_a_change_is_recorded_once_until_the_pool_reaches_it(tmp_path: Path) -> None:
    prefill, decode = _pools(1, 1, decode_booting=1)
    deployments = _deployed(prefill, decode)
    metrics = GatewayMetrics([])
    store = SqliteVersionStore(tmp_path / "versions.db")
    await store.start()
    planner = GatewayPlanner(
        _config(), deployments, Script(), dry_run_actuator(deployments), metrics,
        audit_store=store,
    )  # fmt: skip
    for _ in range(3):  # a dry run: the pools stay, the planner asks the same every step
        await planner.run_once()

    def decisions(pool: str) -> float | None:
        labels = {"version": V1, "pool": pool, "direction": "up"}
        return _sample(metrics, "tandem_planner_decisions_total", **labels)

    assert (decisions("prefill"), decisions("decode")) == (1, 1)
    entries = await store.audit()
    assert [(e.actor, e.action, e.alias, e.subject) for e in entries] == [
        ("planner", "pool.scale", "smol", V1)
    ] * 2
    assert [(e.before, e.after, e.reason) for e in entries] == [
        ({"pool": "prefill", "replicas": 1},
         {"pool": "prefill", "replicas": 2, "recommended": 2, "dry_run": True}, "load needs 2"),
        ({"pool": "decode", "replicas": 2},
         {"pool": "decode", "replicas": 7, "recommended": 7, "dry_run": True}, "load needs 7"),
    ]  # fmt: skip
    [version] = planner.status()["versions"]
    pool = version["pools"]["decode"]
    assert (pool["ready"], pool["starting"], pool["desired"]) == (1, 1, 7)
    assert (pool["min_replicas"], pool["max_replicas"]) == (1, 8)
    # Asked three times, one change (the steps are in "last").
    assert [(d["current"], d["desired"], d["error"]) for d in pool["decisions"]] == [(2, 7, None)]
    assert _sample(metrics, "tandem_planner_current_replicas", version=V1, pool="decode") == 2

    decode.resize(7)  # the pool got there: the same change later is a new one
    await planner.run_once()
    decode.resize(2)
    await planner.run_once()
    assert decisions("decode") == 2

    deployments.remove(V1)
    await planner.run_once()
    assert planner.status()["versions"] == []
    assert _sample(metrics, "tandem_planner_desired_replicas", version=V1, pool="decode") is None
    await store.aclose()


async def test_a_change_held_while_paused_is_recorded_again_when_carried_out(
    tmp_path: Path,
) -> None:
    prefill, decode = _pools(2, 7)
    deployments = _deployed(prefill, decode)
    store = SqliteVersionStore(tmp_path / "versions.db")
    await store.start()
    actuator = dry_run_actuator(deployments)  # the pools stay as they are
    config = dataclasses.replace(_config(mode="local"), paused=True)
    planner = GatewayPlanner(
        config, deployments, Script(then=Load(30, 128, 10)), actuator, GatewayMetrics([]),
        audit_store=store,
    )  # fmt: skip
    await planner.run_once()
    await planner.run_once()
    assert list(actuator.requested) == []  # paused: nothing asked of the actuator
    planner.resume()
    await planner.run_once()
    assert [r.pool for r in actuator.requested] == ["prefill", "decode"]
    entries = await store.audit()
    # Held twice while paused (recorded once), then asked of the actuator: recorded again.
    assert [(e.before["pool"], e.after["dry_run"]) for e in entries] == [
        ("prefill", True),
        ("decode", True),
        ("prefill", False),
        ("decode", False),
    ]
    assert entries[-1].after["replicas"] == actuator.requested[-1].replicas == 8
    await store.aclose()


async def test_only_the_holder_of_the_planner_lease_plans(tmp_path: Path) -> None:
    prefill, decode = _pools(1, 1)
    deployments = _deployed(prefill, decode)
    leases = [SqliteLease(tmp_path / "lease.db", name=LEASE_NAME) for _ in range(2)]
    actuators = [DryRunActuator({(V1, "prefill"): 1, (V1, "decode"): 1}) for _ in range(2)]
    planners = [
        GatewayPlanner(
            _config(mode="kubernetes"),
            deployments,
            Script(),
            actuator,
            GatewayMetrics([]),
            audit_store=None,
            lease=lease,
            holder=f"gw-{i}",
        )
        for i, (lease, actuator) in enumerate(zip(leases, actuators, strict=True))
    ]
    for planner in planners:
        await planner.run_once()
    assert [len(actuator.requested) for actuator in actuators] == [2, 0]
    status = planners[1].status()
    assert status["lease"] == {"name": "planner", "holder": "gw-1", "held": False}
    assert status["versions"] == []

    await planners[0].aclose()  # releases the lease: the other takes over at its next pass
    await planners[1].run_once()
    assert len(actuators[1].requested) == 2
    assert planners[1].status()["lease"]["held"] is True
    await planners[1].aclose()
    for lease in leases:
        await lease.aclose()


def test_a_planner_without_a_profile_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert planner_config(TandemSettings(state_dir=tmp_path)).mode == "off"  # no profile needed
    with pytest.raises(ProfileError, match="tandem profile") as refused:
        planner_config(TandemSettings(planner="dry-run", state_dir=tmp_path))
    assert str(tmp_path / "profile.json") in str(refused.value)
    PROFILE.save(tmp_path / "elsewhere.json")
    found = planner_config(
        TandemSettings(planner="dry-run", planner_profile=tmp_path / "elsewhere.json")
    )
    assert found.profile == PROFILE

    # `tandem up` stops before preparing any model or booting any worker.
    monkeypatch.setenv("TANDEM_PLANNER", "dry-run")
    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["up", "--port", str(port)]) == 1
    said = capsys.readouterr().err
    assert "no worker profile at" in said and "tandem profile" in said
    assert "TANDEM_PLANNER_PROFILE" in said


def test_pool_limits_are_checked_together() -> None:
    with pytest.raises(ValueError, match="TANDEM_PLANNER_DECODE_MIN_REPLICAS"):
        TandemSettings(planner_decode_min_replicas=3, planner_decode_max_replicas=2)
