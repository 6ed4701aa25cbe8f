"""WorkerPool: readiness, health polling, restart with backoff, external workers, picking."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from core.messages import WorkerRole
from decode_pool import DecodePool
from prefill_pool import PrefillPool
from tests.workers.test_process import (
    FAKE_WORKER,
    alive,
    fake_spec,
    free_port,
    kill_leftovers,
    wait_for,
    worker_info,
)
from workers.pool import PoolConfig, WorkerPool, WorkerStartupError

# Short intervals so each test takes a fraction of a second; replace() sets the rest.
FAST = PoolConfig(
    WorkerRole.PREFILL,
    health_interval_s=0.05,
    health_timeout_s=1.0,
    restart_backoff_initial_s=0.2,
    restart_backoff_max_s=1.0,
    stop_timeout_s=5.0,
)


def pool_config(tmp_path: Path, *specs_env: dict[str, str]) -> PoolConfig:
    """A fast prefill pool of fake workers, one per ``specs_env`` (their extra environment)."""
    specs = tuple(fake_spec(tmp_path, f"prefill-{i}", **env) for i, env in enumerate(specs_env))
    return replace(FAST, specs=specs, log_dir=tmp_path / "logs")


def restarted(tmp_path: Path, old_pid: int) -> Callable[[], bool]:
    """A condition: the fake worker reporting in ``tmp_path`` is a new process."""
    return lambda: worker_info(tmp_path).get("pid") not in (None, old_pid)


async def test_start_ready_aclose_leaves_no_process(tmp_path: Path) -> None:
    pool = PrefillPool(pool_config(tmp_path, {}, {}))
    lines: list[str] = []
    await pool.start()
    try:
        await pool.wait_ready(timeout_s=30, on_progress=lines.append)
        assert all(w.healthy for w in pool.workers)
        infos = [worker_info(tmp_path, f"prefill-{i}") for i in range(2)]
        pids = [pid for info in infos for pid in (info["pid"], info["grandchild_pid"])]
        assert all(alive(pid) for pid in pids)
    finally:
        await pool.aclose()
    assert lines[-1] == "prefill-0: healthy | prefill-1: healthy"
    assert not any(alive(pid) for pid in pids)
    assert not any(w.healthy for w in pool.workers)


async def test_killed_worker_is_reported_and_restarted_with_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.workers")
    pool = WorkerPool(pool_config(tmp_path, {}))
    await pool.start()
    try:
        await pool.wait_ready(timeout_s=30)
        (worker,) = pool.workers
        process = pool.process("prefill-0")
        assert process is not None
        delays = []
        for _ in range(2):
            old = worker_info(tmp_path)
            old_pid = old["pid"]
            os.kill(old_pid, signal.SIGKILL)
            await wait_for(lambda: not worker.healthy, timeout_s=10)
            # A new pid, and the old worker's grandchild swept from its process group.
            await wait_for(restarted(tmp_path, old_pid))
            assert not alive(old["grandchild_pid"])
            await wait_for(lambda: worker.healthy)
            record = next(r for r in reversed(caplog.records) if "exited" in r.getMessage())
            message = record.getMessage()
            assert record.levelno == logging.ERROR
            assert "prefill-0" in message
            assert "signal SIGKILL" in message
            assert str(process.log_path) in message
            delays.append(message.split("restarting in ")[1].split(" s")[0])
        assert delays == ["0.2", "0.4"]  # exponential backoff
        (status,) = pool.status()
        assert (status.num_restarts, status.last_exit_code) == (2, -signal.SIGKILL)
        assert status.pid == process.pid == worker_info(tmp_path)["pid"]
    finally:
        await pool.aclose()
    assert not alive(worker_info(tmp_path)["pid"])


async def test_backoff_resets_after_a_healthy_while(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.workers")
    pool = WorkerPool(replace(pool_config(tmp_path, {}), backoff_reset_after_s=0.3))
    await pool.start()
    try:
        (worker,) = pool.workers
        for _ in range(2):
            await pool.wait_ready(timeout_s=30)
            await asyncio.sleep(0.4)  # healthy for longer than backoff_reset_after_s
            old_pid = worker_info(tmp_path)["pid"]
            os.kill(old_pid, signal.SIGKILL)
            await wait_for(restarted(tmp_path, old_pid))
            await wait_for(lambda: worker.healthy)
    finally:
        await pool.aclose()
    exits = [r.getMessage() for r in caplog.records if "restarting in" in r.getMessage()]
    delays = [message.split("restarting in ")[1][:3] for message in exits]
    assert delays == ["0.2", "0.2"], caplog.text


async def test_worker_exiting_at_startup_fails_wait_ready(tmp_path: Path) -> None:
    pool = WorkerPool(pool_config(tmp_path, {}, {"FAKE_WORKER_EXIT_CODE": "3"}))
    await pool.start()
    try:
        with pytest.raises(WorkerStartupError) as excinfo:
            await pool.wait_ready(timeout_s=30)
    finally:
        await pool.aclose()
    message = str(excinfo.value)
    assert "prefill-1 exited during startup (exit code 3); log: " in message
    assert str(tmp_path / "logs" / "prefill-1.log") in message
    assert "fake worker: failing at startup with code 3" in message  # the log's last lines


async def test_wait_ready_times_out_naming_the_unhealthy_worker(tmp_path: Path) -> None:
    pool = WorkerPool(pool_config(tmp_path, {"FAKE_WORKER_HEALTH_STATUS": "503"}))
    lines: list[str] = []
    await pool.start()
    try:
        await wait_for(lambda: bool(worker_info(tmp_path)))  # serving: its checks get a 503
        with pytest.raises(WorkerStartupError) as excinfo:
            await pool.wait_ready(timeout_s=1, on_progress=lines.append)
    finally:
        await pool.aclose()
    assert "prefill-0 not healthy after 1 s (last check: HTTP 503); log: " in str(excinfo.value)
    assert lines[0].startswith("prefill-0: starting (")


async def test_external_worker_is_polled_never_launched(tmp_path: Path) -> None:
    port = free_port()
    info_file = tmp_path / "external.json"
    external = await asyncio.create_subprocess_exec(
        *FAKE_WORKER,
        "--port",
        str(port),
        env={**os.environ, "FAKE_WORKER_INFO_FILE": str(info_file)},
    )
    url = f"http://127.0.0.1:{port}"
    pool = DecodePool(replace(FAST, role=WorkerRole.DECODE, external_urls=(f"{url}/",)))
    await wait_for(info_file.exists)
    # Direct children only: a worker the pool launched would be one (workers/process.py), and
    # grandchildren come and go on their own (the session's e2e stack restarts the workers its
    # fault tests killed while later tests run).
    children_before = {p.pid for p in psutil.Process().children()}
    await pool.start()
    try:
        await pool.wait_ready(timeout_s=30)
        (worker,) = pool.workers
        assert (worker.name, worker.base_url, worker.healthy) == ("decode-ext-0", url, True)
        assert pool.process("decode-ext-0") is None
        assert not pool.status()[0].managed
        # The pool launched nothing of its own.
        assert {p.pid for p in psutil.Process().children()} <= children_before
        external.kill()
        await external.wait()
        await wait_for(lambda: not worker.healthy)
    finally:
        await pool.aclose()
        if external.returncode is None:
            external.kill()
            await external.wait()
        if info_file.exists():
            kill_leftovers(worker_info(tmp_path, "external")["grandchild_pid"])


async def test_external_worker_never_healthy_times_out_with_its_url(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    pool = WorkerPool(replace(FAST, external_urls=(url,)))
    await pool.start()
    try:
        with pytest.raises(
            WorkerStartupError, match=re.escape(f"prefill-ext-0 ({url}) not healthy")
        ):
            await pool.wait_ready(timeout_s=0.3)
    finally:
        await pool.aclose()


def test_pick_skips_unhealthy_and_prefers_least_outstanding() -> None:
    pool = WorkerPool(
        PoolConfig(WorkerRole.DECODE, external_urls=("http://a:1", "http://b:1", "http://c:1"))
    )
    a, b, c = pool.workers
    assert pool.pick() is None  # nothing is healthy before the first health check
    a.healthy = b.healthy = True
    a.num_outstanding, b.num_outstanding, c.num_outstanding = 3, 1, 0
    assert pool.pick() is b  # c has the fewest requests but is unhealthy
    with b.lease(), b.lease(), b.lease():
        assert pool.pick() is a  # tie at 3: the first listed wins
    assert pool.pick() is b


def test_config_rejects_a_spec_of_the_other_role(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "decode-0")
    with pytest.raises(ValueError, match=r"decode-0 has role decode in a prefill pool"):
        PoolConfig(WorkerRole.PREFILL, specs=(spec,))
    with pytest.raises(ValueError, match=r"PoolConfig\.role must be 'prefill'"):
        PrefillPool(PoolConfig(WorkerRole.DECODE, specs=(spec,)))


async def test_launch_failure_in_start_raises_and_stops_the_others(tmp_path: Path) -> None:
    good = fake_spec(tmp_path, "prefill-0")
    bad = fake_spec(tmp_path, "prefill-1")
    bad = replace(bad, launch=replace(bad.launch, command=(str(tmp_path / "no-such-program"),)))
    pool = WorkerPool(replace(FAST, specs=(good, bad), log_dir=tmp_path))
    with pytest.raises(FileNotFoundError):
        await pool.start()
    process = pool.process("prefill-0")
    assert process is not None
    assert process.returncode is not None  # the worker started first was stopped again


async def test_one_slow_health_check_does_not_take_a_worker_out(tmp_path: Path) -> None:
    """A CPU-starved server misses a check now and then; only a run of failures counts."""
    from workers.pool import _Member  # the health bookkeeping under test

    pool = WorkerPool(
        PoolConfig(WorkerRole.DECODE, external_urls=("http://127.0.0.1:9",), log_dir=tmp_path)
    )
    member: _Member = pool._members[0]
    member.worker.healthy = True
    pool._set_health(member, "TimeoutError")
    pool._set_health(member, "TimeoutError")
    assert member.worker.healthy, "two slow checks in a row are tolerated"
    pool._set_health(member, None)
    pool._set_health(member, "TimeoutError")
    pool._set_health(member, "TimeoutError")
    assert member.worker.healthy, "a success resets the count"
    pool._set_health(member, "TimeoutError")
    assert not member.worker.healthy, "the third failure in a row takes it out"
    pool._set_health(member, None)
    assert member.worker.healthy
    pool._set_health(member, "ClientConnectorError", definitive=True)
    assert not member.worker.healthy, "a refused connection counts at once"


# --- growing and shrinking a started pool (the planner's local actuator) -----------------------
async def started_pool(tmp_path: Path, num_workers: int) -> WorkerPool:
    """A started fast prefill pool of ``num_workers`` healthy fake workers."""
    pool = WorkerPool(pool_config(tmp_path, *({} for _ in range(num_workers))))
    await pool.start()
    try:
        await pool.wait_ready(timeout_s=30)
    except BaseException:
        await pool.aclose()
        raise
    return pool


async def test_add_launches_a_supervised_worker_that_becomes_healthy(tmp_path: Path) -> None:
    pool = await started_pool(tmp_path, 1)
    try:
        added = await pool.add(fake_spec(tmp_path, "prefill-1"))
        assert [w.name for w in pool.workers] == ["prefill-0", "prefill-1"]
        assert added is pool.workers[1]
        assert pool.process("prefill-1") is not None
        await wait_for(lambda: added.healthy)  # the pool's health poller reaches it
        info = worker_info(tmp_path, "prefill-1")
        assert alive(info["pid"]) and alive(info["grandchild_pid"])
        os.kill(info["pid"], signal.SIGKILL)
        await wait_for(lambda: not added.healthy, timeout_s=10)
        await wait_for(lambda: worker_info(tmp_path, "prefill-1")["pid"] != info["pid"])
        await wait_for(lambda: added.healthy)
        status = next(s for s in pool.status() if s.name == "prefill-1")
        assert (status.num_restarts, status.last_exit_code) == (1, -signal.SIGKILL)
        assert pool.workers[0].healthy  # the other one was never touched
    finally:
        await pool.aclose()
    assert not alive(worker_info(tmp_path, "prefill-1")["pid"])  # aclose stops the added one


async def test_add_needs_a_started_pool_a_new_name_and_the_pools_role(tmp_path: Path) -> None:
    idle = WorkerPool(pool_config(tmp_path, {}))
    with pytest.raises(RuntimeError, match="start"):
        await idle.add(fake_spec(tmp_path, "prefill-1"))
    assert idle.process("prefill-1") is None
    assert not (tmp_path / "prefill-1.json").exists()  # nothing was launched

    pool = await started_pool(tmp_path, 1)
    try:
        with pytest.raises(ValueError, match="prefill-0"):
            await pool.add(fake_spec(tmp_path, "prefill-0"))  # one from the configuration
        await pool.add(fake_spec(tmp_path, "prefill-1"))
        with pytest.raises(ValueError, match="prefill-1"):
            await pool.add(fake_spec(tmp_path, "prefill-1"))  # one added earlier
        with pytest.raises(ValueError, match="decode-0"):
            await pool.add(fake_spec(tmp_path, "decode-0"))  # a decode spec in a prefill pool
        assert [w.name for w in pool.workers] == ["prefill-0", "prefill-1"]
    finally:
        await pool.aclose()


async def test_drain_of_an_idle_worker_stops_it_and_removes_it(tmp_path: Path) -> None:
    pool = await started_pool(tmp_path, 2)
    try:
        leaving, staying = pool.workers
        info = worker_info(tmp_path, "prefill-0")
        drained = await pool.drain("prefill-0", timeout_s=10)
        assert (drained.name, drained.cut, drained.kv_unread) == ("prefill-0", 0, 0)
        assert drained.waited_s < 1  # nothing to wait for
        assert not alive(info["pid"]) and not alive(info["grandchild_pid"])
        assert pool.workers == [staying]
        assert pool.process("prefill-0") is None
        assert [s.name for s in pool.status()] == ["prefill-1"]
        assert not leaving.healthy and not leaving.in_rotation
        assert staying.healthy and pool.pick() is staying
    finally:
        await pool.aclose()


async def test_a_drained_worker_stopping_slowly_is_not_reported_unhealthy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM worker refuses connections for seconds while its engine stops: the health polls
    of that stop are the drain's doing, not a failure to warn an operator about."""
    caplog.set_level(logging.INFO, logger="tandem.workers")
    pool = WorkerPool(pool_config(tmp_path, {"FAKE_WORKER_STOP_S": "1.0"}, {}))
    await pool.start()
    try:
        await pool.wait_ready(timeout_s=30)
        leaving, staying = pool.workers
        drain = asyncio.create_task(pool.drain("prefill-0", timeout_s=10))
        await wait_for(lambda: not leaving.healthy, timeout_s=5)
        assert not drain.done()  # still stopping: ~20 health rounds of refused connections
        await drain
        assert pool.workers == [staying]
    finally:
        await pool.aclose()
    assert not [
        r.getMessage() for r in caplog.records if "prefill-0 is unhealthy" in r.getMessage()
    ]
    assert "prefill-0 drained in" in caplog.text


async def test_a_drained_worker_is_not_restarted(tmp_path: Path) -> None:
    pool = await started_pool(tmp_path, 1)
    try:
        info = worker_info(tmp_path, "prefill-0")
        await pool.drain("prefill-0", timeout_s=10)
        # Well past the 0.2 s restart backoff and several health rounds.
        await asyncio.sleep(1.0)
        assert worker_info(tmp_path, "prefill-0")["pid"] == info["pid"]  # no new process
        assert not alive(info["pid"])
        assert pool.workers == [] and pool.pick() is None
    finally:
        await pool.aclose()


async def test_drain_waits_for_requests_in_flight_out_of_rotation(tmp_path: Path) -> None:
    pool = await started_pool(tmp_path, 2)
    try:
        leaving, staying = pool.workers
        staying.num_outstanding = 5  # the draining one would be the least loaded
        pid = worker_info(tmp_path, "prefill-0")["pid"]
        with leaving.lease():
            drain = asyncio.create_task(pool.drain("prefill-0", timeout_s=30))
            await asyncio.sleep(0)  # the drain's first step
            assert leaving.draining and not leaving.in_rotation
            assert pool.pick() is staying
            await asyncio.sleep(0.5)  # several of its polls
            assert not drain.done()
            assert alive(pid) and leaving in pool.workers
            assert leaving.healthy  # still health-checked, still serving what it has
        drained = await asyncio.wait_for(drain, timeout=10)
        assert (drained.cut, drained.kv_unread) == (0, 0)
        assert drained.waited_s >= 0.4  # it waited for the release, not a poll's worth
        assert not alive(pid) and pool.workers == [staying]
    finally:
        await pool.aclose()


async def test_drain_waits_for_kv_a_decode_leg_has_yet_to_read(tmp_path: Path) -> None:
    pool = await started_pool(tmp_path, 1)
    try:
        (worker,) = pool.workers
        pid = worker_info(tmp_path, "prefill-0")["pid"]
        released = asyncio.Event()

        async def decode_leg() -> None:
            with worker.holding_kv():
                await released.wait()

        leg = asyncio.create_task(decode_leg())
        await asyncio.sleep(0)
        drain = asyncio.create_task(pool.drain("prefill-0", timeout_s=30))
        await asyncio.sleep(0.5)
        assert worker.draining and pool.pick() is None
        assert not drain.done() and alive(pid)
        released.set()
        await leg
        drained = await asyncio.wait_for(drain, timeout=10)
        assert (drained.cut, drained.kv_unread) == (0, 0)
        assert not alive(pid) and pool.workers == []
    finally:
        await pool.aclose()


async def test_drain_past_its_deadline_stops_the_worker_and_counts_what_it_cut(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.workers")
    pool = await started_pool(tmp_path, 2)
    try:
        first, second = pool.workers
        pids = [worker_info(tmp_path, f"prefill-{i}")["pid"] for i in range(2)]
        with first.lease():
            drained = await asyncio.wait_for(pool.drain("prefill-0", timeout_s=0.3), timeout=10)
            assert (drained.cut, drained.kv_unread) == (1, 0)
            assert drained.waited_s >= 0.3  # the deadline, not the request's end
            assert not alive(pids[0])  # stopped while its request still ran
        with second.holding_kv():
            drained = await asyncio.wait_for(pool.drain("prefill-1", timeout_s=0.3), timeout=10)
            assert (drained.cut, drained.kv_unread) == (0, 1)
            assert not alive(pids[1])
        assert pool.workers == []
    finally:
        await pool.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("prefill-0 stopped after" in m and "1 requests in flight" in m for m in warnings)
    assert any("prefill-1 stopped after" in m and "1 KV reads pending" in m for m in warnings)


async def test_drain_refuses_an_unknown_or_external_worker(tmp_path: Path) -> None:
    pool = WorkerPool(replace(pool_config(tmp_path, {}), external_urls=("http://127.0.0.1:9",)))
    managed, external = pool.workers
    with pytest.raises(ValueError, match="prefill-9"):
        await pool.drain("prefill-9", timeout_s=1)
    with pytest.raises(ValueError, match="prefill-ext-0"):
        await pool.drain("prefill-ext-0", timeout_s=1)
    assert pool.workers == [managed, external]
    assert not external.draining and not managed.draining
