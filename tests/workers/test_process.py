"""WorkerProcess and the vLLM command line: real child processes of a fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import signal
import sys
import textwrap
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from core.messages import WorkerRole
from decode_pool import decode_worker_specs
from kv_transfer.connector import ConnectorConfig
from kv_transfer.nixl_progress import KEEP_BINDING_ENV
from prefill_pool import prefill_worker_specs
from tests.server_process import free_port
from workers.process import (
    THP_ENV,
    LaunchConfig,
    WorkerProcess,
    WorkerSpec,
    worker_argv,
    worker_env,
)
from workers.vllm_busy_wait import PAUSE_ENV

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_WORKER = (sys.executable, str(Path(__file__).with_name("fake_worker.py")))


def fake_spec(tmp_path: Path, name: str = "prefill-0", **env: str) -> WorkerSpec:
    """A spec that launches the fake engine, which reports itself in ``<tmp>/<name>.json``."""
    launch = LaunchConfig(
        model_path=tmp_path / "model",
        served_model_name="fake",
        command=FAKE_WORKER,
        extra_env={"FAKE_WORKER_INFO_FILE": str(tmp_path / f"{name}.json"), **env},
    )
    role = WorkerRole.DECODE if name.startswith("decode") else WorkerRole.PREFILL
    return WorkerSpec(name, role, port=free_port(), side_channel_port=free_port(), launch=launch)


async def wait_for(
    condition: Callable[[], bool | Awaitable[bool]], timeout_s: float = 30.0
) -> None:
    """Poll ``condition`` until true; fail the test at the deadline (generous: CI may be busy)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"condition not met within {timeout_s} s"
        await asyncio.sleep(0.02)


def worker_info(tmp_path: Path, name: str = "prefill-0") -> dict[str, Any]:
    path = tmp_path / f"{name}.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_leftovers(*pids: int) -> None:
    """Don't let a failing test leave processes behind for the next ones."""
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()


async def healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


def test_prefill_and_decode_command_lines() -> None:
    launch = LaunchConfig(
        model_path=Path("/models/smol"),
        served_model_name="smol",
        max_model_len=2048,
        kv_cache_gib=2,
        enforce_eager=True,
        dtype="float32",
        block_size=128,
        connector=ConnectorConfig(progress_delay_us=2000),
        extra_env={"HF_HUB_OFFLINE": "0"},
    )
    (prefill,) = prefill_worker_specs(
        launch, num_workers=1, base_port=9100, base_side_channel_port=6100, cpu_binds=("0",)
    )
    decode_0, decode_1 = decode_worker_specs(
        launch, num_workers=2, base_port=9200, base_side_channel_port=6200, cpu_binds=("1",)
    )

    argv = worker_argv(prefill)
    assert argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model"] == "/models/smol"
    assert flags["--served-model-name"] == "smol"
    assert (flags["--host"], flags["--port"]) == ("127.0.0.1", "9100")
    assert flags["--max-model-len"] == "2048"
    assert "--enforce-eager" in argv
    assert "--enable-prompt-tokens-details" in argv  # cached prompt tokens reach the ledger
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--block-size") + 1] == "128"  # the gateway counts KV bytes with it
    # The API server gives its engine core time to exit in order instead of SIGKILLing it.
    assert argv[argv.index("--shutdown-timeout") + 1] == "10"
    # Requests carry their tenant's band as vLLM's priority (gateway/serving/gate.py).
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    assert "--max-num-batched-tokens" not in argv  # vLLM's own step budget unless given
    stepped = replace(decode_0, launch=replace(launch, max_num_batched_tokens=64))
    stepped_argv = worker_argv(stepped)
    assert stepped_argv[stepped_argv.index("--max-num-batched-tokens") + 1] == "64"
    assert json.loads(flags["--kv-transfer-config"]) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_lease_duration": 10, "backends": ["UCX"]},
    }
    assert (
        json.loads(worker_argv(decode_1)[worker_argv(decode_1).index("--kv-transfer-config") + 1])[
            "kv_role"
        ]
        == "kv_consumer"
    )

    assert (prefill.name, decode_0.name, decode_1.name) == ("prefill-0", "decode-0", "decode-1")
    assert (decode_0.port, decode_1.port) == (9200, 9201)
    assert decode_1.base_url == "http://127.0.0.1:9201"

    env = worker_env(prefill)
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "6100"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["HF_HUB_OFFLINE"] == "0"  # extra_env wins over Tandem's own settings
    assert env["TANDEM_NIXL_PROGRESS_DELAY_US"] == "2000"  # read by kv_transfer.nixl_progress
    assert worker_env(decode_0)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert worker_env(decode_1)["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "6201"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in worker_env(decode_1)  # past the end of cpu_binds
    # Pinned workers ask Tandem's vLLM plugin to keep NIXL from moving the model's thread.
    assert worker_env(decode_0)[KEEP_BINDING_ENV] == "1"
    assert KEEP_BINDING_ENV not in worker_env(decode_1)


def test_optional_flags_are_left_out() -> None:
    spec = WorkerSpec(
        "decode-0",
        WorkerRole.DECODE,
        port=1,
        side_channel_port=2,
        launch=LaunchConfig(model_path=Path("m"), served_model_name="m", host="0.0.0.0"),
    )
    assert spec.base_url == "http://127.0.0.1:1"  # a wildcard bind is reached on loopback
    argv = worker_argv(spec)
    assert "--max-model-len" not in argv
    assert "--enforce-eager" not in argv
    assert "--block-size" not in argv
    assert worker_env(spec)["HF_HUB_OFFLINE"] == "1"


def test_workers_ask_torch_for_huge_pages_unless_the_environment_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = WorkerSpec(
        "prefill-0",
        WorkerRole.PREFILL,
        port=1,
        side_channel_port=2,
        launch=LaunchConfig(model_path=Path("m"), served_model_name="m"),
    )
    monkeypatch.delenv(THP_ENV, raising=False)
    assert worker_env(spec)[THP_ENV] == "1"
    monkeypatch.setenv(THP_ENV, "0")
    assert THP_ENV not in worker_env(spec)  # the inherited "0" reaches the worker as it is


def test_workers_wait_for_their_next_message_sleeping_unless_set_to_spin() -> None:
    def spec(**launch: int) -> WorkerSpec:
        config = LaunchConfig(model_path=Path("m"), served_model_name="m", **launch)
        return WorkerSpec("decode-0", WorkerRole.DECODE, port=1, side_channel_port=2, launch=config)

    assert worker_env(spec())[PAUSE_ENV] == "100"
    assert worker_env(spec(busy_wait_pause_us=250))[PAUSE_ENV] == "250"
    assert PAUSE_ENV not in worker_env(spec(busy_wait_pause_us=0))  # vLLM's own spin


async def test_start_ready_aclose_leaves_no_process(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, "decode-0")
    process = WorkerProcess(spec, tmp_path / "logs")
    await process.start()
    try:
        await wait_for(lambda: healthy(spec.base_url))
        info = worker_info(tmp_path, "decode-0")
        assert info["pid"] == process.pid
        # The environment built for the worker really reached it.
        assert info["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)
        assert "--kv-transfer-config" in info["argv"]
        assert alive(info["grandchild_pid"])
    finally:
        await process.aclose(timeout_s=5)
    assert process.returncode == 0  # stopped by SIGTERM, which the fake handles like vLLM
    assert not alive(info["pid"])
    assert not alive(info["grandchild_pid"])
    log = process.log_path.read_text()
    assert process.log_path == tmp_path / "logs" / "decode-0.log"
    assert "tandem starts decode-0" in log
    assert "fake worker listening" in log  # the child's output went to its log file


async def test_sigkill_after_timeout_and_escaped_descendants_are_reaped(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path, FAKE_WORKER_IGNORE_SIGTERM="1", FAKE_WORKER_ESCAPE_GROUP="1")
    process = WorkerProcess(spec, tmp_path)
    await process.start()
    await wait_for(lambda: bool(worker_info(tmp_path)))
    info = worker_info(tmp_path)
    assert alive(info["grandchild_pid"])

    await process.aclose(timeout_s=0.5)

    assert process.returncode == -signal.SIGKILL
    assert not alive(info["pid"])
    assert not alive(info["grandchild_pid"])  # outside the group, found via psutil


async def test_restart_after_exit_appends_to_the_same_log(tmp_path: Path) -> None:
    spec = fake_spec(tmp_path)
    process = WorkerProcess(spec, tmp_path)
    await process.start()
    first_pid = process.pid
    await process.aclose(timeout_s=5)
    await process.start()
    try:
        assert process.pid != first_pid
        assert process.running
    finally:
        await process.aclose(timeout_s=5)
    assert process.log_path.read_text().count("tandem starts prefill-0") == 2


async def test_worker_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """A gateway killed with SIGKILL gets no chance to clean up: PDEATHSIG does it."""
    spec = fake_spec(tmp_path)
    script = textwrap.dedent(
        f"""
        import asyncio, pickle, sys
        from pathlib import Path
        from workers.process import WorkerProcess

        async def main():
            spec = pickle.loads(bytes.fromhex(sys.argv[1]))
            await WorkerProcess(spec, Path({str(tmp_path)!r})).start()
            await asyncio.sleep(600)

        asyncio.run(main())
        """
    )
    gateway = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, pickle.dumps(spec).hex(), cwd=REPO_ROOT
    )
    try:
        await wait_for(lambda: bool(worker_info(tmp_path)))
        info = worker_info(tmp_path)
        assert psutil.Process(info["pid"]).ppid() == gateway.pid
    finally:
        gateway.kill()
        await gateway.wait()
    try:
        await wait_for(lambda: not alive(info["pid"]) and not alive(info["grandchild_pid"]))
    finally:
        kill_leftovers(info["pid"], info["grandchild_pid"])


async def test_stop_signals_the_server_alone_which_stops_its_engine(tmp_path: Path) -> None:
    """vLLM's API server stops its engine core itself; a SIGTERM from the supervisor reaching
    the engine core first makes the server log the shutdown as a crash (EngineDeadError)."""
    record = tmp_path / "engine.json"
    spec = fake_spec(tmp_path, FAKE_WORKER_ENGINE_RECORD=str(record))
    process = WorkerProcess(spec, tmp_path / "logs")
    await process.start()
    try:
        await wait_for(lambda: record.is_file() and bool(worker_info(tmp_path)))
        server_pid = worker_info(tmp_path)["pid"]
    finally:
        await process.aclose(timeout_s=5)
    assert json.loads(record.read_text()) == {"signal": "SIGTERM", "sender_pid": server_pid}
    assert process.returncode == 0  # the server exited on its own, not by SIGKILL
