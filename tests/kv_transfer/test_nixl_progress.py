"""The plugin that gives NIXL's progress thread a poll timeout instead of a busy loop, and
NIXL's threads a nice value that leaves the model's thread its core."""

from __future__ import annotations

import importlib
import os
import threading
import time
from types import ModuleType, SimpleNamespace
from typing import Any

import psutil
import pytest

from kv_transfer import nixl_progress
from kv_transfer.connector import ConnectorConfig, connector_env
from kv_transfer.nixl_progress import (
    DELAY_ENV,
    KEEP_BINDING_ENV,
    NICE_ENV,
    DelayedAgentBinding,
    install,
    install_nice,
    keeping_binding,
    parse_delay,
    parse_nice,
)


class FakeBinding(ModuleType):
    """What nixl_agent.__init__ touches on the native binding, recording each agent's config."""

    DEFAULT_COMM_PORT = 5555

    def __init__(self) -> None:
        super().__init__("fake_bindings")
        self.created: list[tuple[str, Any]] = []

    def nixlAgent(self, name: str, config: Any) -> str:
        self.created.append((name, config))
        return f"agent:{name}"


def fake_api() -> ModuleType:
    api = ModuleType("fake_api")
    api.nixlBind = FakeBinding()  # type: ignore[attr-defined]
    return api


def agent_config(*, prog_thread: bool = True) -> SimpleNamespace:
    # As nixl_agent.__init__ leaves it: the delay forced to 0.
    return SimpleNamespace(useProgThread=prog_thread, pthrDelay=0)


def test_agents_created_through_the_api_get_the_delay() -> None:
    api = fake_api()
    binding = api.nixlBind
    assert install(api, 1000)
    assert isinstance(api.nixlBind, DelayedAgentBinding)
    config = agent_config()
    assert api.nixlBind.nixlAgent("a", config) == "agent:a"
    assert binding.created == [("a", config)] and config.pthrDelay == 1000
    # Everything else is the binding's own.
    assert api.nixlBind.DEFAULT_COMM_PORT == 5555


def test_an_agent_without_a_progress_thread_is_left_alone() -> None:
    api = fake_api()
    install(api, 1000)
    config = agent_config(prog_thread=False)
    api.nixlBind.nixlAgent("a", config)
    assert config.pthrDelay == 0


def test_installing_twice_updates_the_delay_without_wrapping_twice() -> None:
    api = fake_api()
    install(api, 1000)
    wrapper = api.nixlBind
    install(api, 5000)
    assert api.nixlBind is wrapper and wrapper.delay_us == 5000


def test_an_api_without_the_binding_is_reported_not_broken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = ModuleType("newer_nixl_api")
    assert not install(api, 1000)
    assert not hasattr(api, "nixlBind")
    assert DELAY_ENV in caplog.text


@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("1000", 1000)])
def test_parse_delay(raw: str, expected: int) -> None:
    assert parse_delay(raw) == expected


@pytest.mark.parametrize(("raw", "match"), [("1ms", "whole number"), ("-1", ">= 0")])
def test_a_bad_delay_names_the_variable(raw: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_delay(raw)
    assert DELAY_ENV in str(info.value)


def test_register_does_nothing_unless_tandem_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DELAY_ENV, raising=False)
    imported: list[str] = []
    monkeypatch.setattr(nixl_progress.importlib, "import_module", imported.append)
    nixl_progress.register()
    assert imported == []


def test_workers_get_the_delay_and_the_ucx_option_vllm_would_have_set() -> None:
    env = connector_env(ConnectorConfig(progress_delay_us=2000), "127.0.0.1", 5600)
    assert env[DELAY_ENV] == "2000"
    assert env[NICE_ENV] == "19"
    assert env["UCX_RCACHE_MAX_UNRELEASED"] == "1024"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"


def _cpu_share_of_process(seconds: float) -> float:
    process = psutil.Process()
    before, start = process.cpu_times(), time.monotonic()
    time.sleep(seconds)
    after = process.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return used / (time.monotonic() - start)


def test_a_real_idle_nixl_agent_no_longer_spins_a_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """With NIXL's own delay of 0 the same idle agent keeps one core at ~100 %."""
    api = importlib.import_module("nixl._api")
    monkeypatch.setattr(api, "nixlBind", api.nixlBind)  # undone after the test
    assert install(api, 1000)
    agent = api.nixl_agent("tandem-test", api.nixl_agent_config(num_threads=1))
    try:
        share = _cpu_share_of_process(1.5)
    finally:
        del agent
    assert share < 0.5, f"an idle NIXL agent used {share:.2f} of a core"


def _call_from_module(name: str, setaffinity: Any, pid: int = 0) -> None:
    """Call ``setaffinity(pid, {1})`` from a function whose module is ``name``."""
    namespace: dict[str, Any] = {"__name__": name, "setaffinity": setaffinity, "pid": pid}
    exec("def reserve():\n    setaffinity(pid, {1})\n", namespace)
    namespace["reserve"]()


def test_nixl_moving_the_main_thread_is_skipped_and_nothing_else() -> None:
    calls: list[tuple[int, set[int]]] = []
    guarded = keeping_binding(lambda pid, mask: calls.append((pid, set(mask))))
    _call_from_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", guarded)
    assert calls == []  # the worker's main thread keeps its binding
    _call_from_module("vllm.v1.worker.cpu_worker", guarded)  # vLLM's own OpenMP binding
    _call_from_module("vllm.distributed.kv_transfer.kv_connector.v1.nixl.x", guarded, pid=42)
    worker = threading.Thread(
        target=_call_from_module,
        args=("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker", guarded),
    )
    worker.start()
    worker.join()
    assert calls == [(0, {1}), (42, {1}), (0, {1})]


def test_register_keeps_the_binding_only_where_tandem_pinned_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = nixl_progress.os.sched_setaffinity
    monkeypatch.delenv(DELAY_ENV, raising=False)
    monkeypatch.delenv(KEEP_BINDING_ENV, raising=False)
    nixl_progress.register()
    assert nixl_progress.os.sched_setaffinity is original
    monkeypatch.setenv(KEEP_BINDING_ENV, "1")
    monkeypatch.setattr(nixl_progress.os, "sched_setaffinity", original)
    nixl_progress.register()
    nixl_progress.register()  # twice: wrapped once
    wrapped = nixl_progress.os.sched_setaffinity
    assert wrapped is not original and getattr(wrapped, "tandem_keeps_binding", False)
    assert wrapped.__closure__ is not None
    assert original in [cell.cell_contents for cell in wrapped.__closure__]


def nice_of(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


class ThreadedAgent:
    """Like ``nixl_agent``: its constructor starts a helper thread that outlives it."""

    def __init__(self, name: str, release: threading.Event) -> None:
        self.name = name
        self.helper = threading.Thread(target=release.wait, name=f"{name}-helper")
        self.helper.start()


def test_threads_an_agent_starts_get_the_nice_value_and_no_other_thread_does() -> None:
    api = ModuleType("fake_api")
    api.nixl_agent = type("nixl_agent", (ThreadedAgent,), {})  # type: ignore[attr-defined]
    release = threading.Event()
    bystander = threading.Thread(target=release.wait)
    bystander.start()
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    try:
        assert install_nice(api, 19)
        agent = api.nixl_agent("a", release)
        assert agent.name == "a"  # the constructor itself ran, with its arguments
        assert nice_of(agent.helper) == 19
        assert nice_of(bystander) == own
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    finally:
        release.set()
        bystander.join()


def test_installing_the_nice_value_twice_updates_it_without_wrapping_twice() -> None:
    api = ModuleType("fake_api")
    api.nixl_agent = type("nixl_agent", (ThreadedAgent,), {})  # type: ignore[attr-defined]
    install_nice(api, 10)
    install_nice(api, 15)
    release = threading.Event()
    try:
        agent = api.nixl_agent("a", release)
        assert nice_of(agent.helper) == 15
        assert api.nixl_agent.__init__.__wrapped__ is ThreadedAgent.__init__
    finally:
        release.set()


def test_an_api_without_the_agent_class_is_reported_not_broken(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert not install_nice(ModuleType("newer_nixl_api"), 19)
    assert NICE_ENV in caplog.text


@pytest.mark.parametrize(("raw", "match"), [("low", "whole number"), ("20", "19"), ("-5", "0")])
def test_a_bad_nice_value_names_the_variable(raw: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_nice(raw)
    assert NICE_ENV in str(info.value)


def test_the_connector_refuses_a_nice_value_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"0 .* to 19"):
        ConnectorConfig(thread_nice=20)


def test_register_installs_the_nice_value_alone_when_only_it_was_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = ModuleType("fake_api")
    api.nixl_agent = type("nixl_agent", (ThreadedAgent,), {})  # type: ignore[attr-defined]
    api.nixlBind = FakeBinding()  # type: ignore[attr-defined]
    monkeypatch.delenv(DELAY_ENV, raising=False)
    monkeypatch.setenv(NICE_ENV, "12")
    monkeypatch.setattr(nixl_progress.importlib, "import_module", lambda name: api)
    nixl_progress.register()
    assert api.nixl_agent.__init__.tandem_nice == 12
    assert isinstance(api.nixlBind, FakeBinding)  # no delay asked, none installed


def test_a_real_nixl_agent_starts_its_threads_while_it_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL's listener, progress and UCX threads exist once the constructor returns, so the
    nice value reaches them: none is started later, at its original priority."""
    api = importlib.import_module("nixl._api")
    monkeypatch.setattr(api.nixl_agent, "__init__", api.nixl_agent.__init__)  # undone after
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = nixl_progress.thread_ids()
    assert install_nice(api, 19)
    agent = api.nixl_agent("tandem-nice-test", api.nixl_agent_config(num_threads=1))
    try:
        started = nixl_progress.thread_ids() - before
        assert len(started) >= 2, f"NIXL started {len(started)} threads"
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in started} == {19}
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    finally:
        del agent
