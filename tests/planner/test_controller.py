"""The controller's step: read, decide, carry out; a missing reading skips the step, a
refusing actuator keeps the pool and the reason."""

from __future__ import annotations

from planner.actuate import ActuatorError, DryRunActuator, PoolName
from planner.controller import LoadUnavailable, PlannerController
from planner.loop import Planner, PoolState
from planner.predict import ConstantPredictor
from planner.replicas import Load, Observed, Targets
from planner.scaling import ScalingPolicy
from tests.planner.test_profile import PROFILE

VERSION = "smol@1"
POLICY = ScalingPolicy(min_replicas=0, max_replicas=32, down_window_s=0, cooldown_s=0)


class Readings:
    """The loads a test hands the controller, one per step (a reading of None fails)."""

    def __init__(self, *loads: Load | None) -> None:
        self._loads = list(loads)

    async def interval(self, version: str, window_s: float) -> tuple[Load, Observed]:
        load = self._loads.pop(0)
        if load is None:
            raise LoadUnavailable("the windows are empty")
        return load, Observed()


class Refusing(DryRunActuator):
    async def scale(self, version: str, pool: PoolName, replicas: int, reason: str) -> None:
        raise ActuatorError(f"deployment of {pool} is locked")


def _controller(source: Readings, actuator: DryRunActuator) -> PlannerController:
    planner = Planner(PROFILE, Targets(1.0, 0.04, 1.0), 30.0, POLICY, POLICY, ConstantPredictor)
    return PlannerController(VERSION, planner, source, actuator, clock=lambda: 0.0)


async def test_a_step_asks_each_pool_for_what_the_load_needs() -> None:
    actuator = DryRunActuator({(VERSION, "prefill"): 1, (VERSION, "decode"): 1})
    controller = _controller(Readings(Load(10, 576, 100)), actuator)
    applied = await controller.run_once()
    assert [(a.pool, a.decision.desired, a.error) for a in applied] == [
        ("prefill", 2, None),
        ("decode", 5, None),
    ]
    assert [(r.pool, r.replicas) for r in actuator.requested] == [("prefill", 2), ("decode", 5)]
    assert list(controller.history) == applied


async def test_no_reading_no_step_and_a_refusal_is_kept_with_its_reason() -> None:
    actuator = Refusing({(VERSION, "prefill"): 2, (VERSION, "decode"): 5})
    controller = _controller(Readings(None, Load(20, 576, 100)), actuator)
    assert await controller.run_once() == []
    prefill, decode = await controller.run_once()
    assert prefill.decision.desired == 4 and prefill.error == "deployment of prefill is locked"
    assert decode.decision.desired == 10 and decode.error is not None
    assert await actuator.state(VERSION, "decode") == PoolState(5)  # unchanged


async def test_changes_are_kept_apart_from_steps_and_a_change_asked_again_once() -> None:
    # A dry run: the pools never move, so each step asks for the same change again.
    actuator = DryRunActuator({(VERSION, "prefill"): 1, (VERSION, "decode"): 1})
    load = Load(10, 576, 100)
    controller = _controller(Readings(*[load] * 3, Load(20, 576, 100)), actuator)
    for _ in range(4):
        await controller.run_once()
    assert len(controller.history) == 8  # every pool's every step
    assert [(c.pool, c.decision.current, c.decision.desired) for c in controller.changes] == [
        ("prefill", 1, 2),
        ("decode", 1, 5),
        ("prefill", 1, 4),  # another change: kept
        ("decode", 1, 10),
    ]
