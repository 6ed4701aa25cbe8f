"""The real stack, booted once per test session: ``tandem up`` with one prefill and one decode
vLLM CPU worker (NIXL between them) and the gateway, all as the README runs it.

Teardown is a test of its own: SIGTERM to ``tandem up`` must leave no process behind.
"""

from __future__ import annotations

import csv
import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from planner.profile import DecodePoint, PrefillPoint, Profile
from tests.otlp_receiver import OtlpReceiver, receiver_in_thread
from tests.server_process import free_port_block

BOOT_TIMEOUT_S = 900.0
ADMIN_KEY = "e2e-admin-key"
MAX_MODEL_LEN = 1024  # small, so the context-length test needs only a modest prompt
DEFAULT_MAX_TOKENS = 48  # the cap of a chat request without max_tokens (well below the window)


@dataclass(frozen=True)
class LiveStack:
    base_url: str  # gateway, e.g. http://127.0.0.1:18000
    model: str
    prefill_url: str
    decode_url: str
    max_model_len: int
    api_key: str  # a key of the unlimited ``e2e`` tenant, created through the admin API
    log_dir: Path | None = None  # each worker's log, <role>-<i>.log
    pid: int = 0  # of ``tandem up``: the workers are its children
    version: str = ""  # the version ``model`` resolves to (alias@8hex): what the workers serve
    # Every key ``new_tenant`` issued this session, so tests/e2e/test_zy_secrets.py can search
    # the stack's logs for each; one list shared by the fixture's two copies of the stack.
    issued_keys: list[str] = field(default_factory=list)

    @property
    def admin(self) -> httpx.Client:
        """A client of the admin API (the caller closes it)."""
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10
        )

    def new_tenant(self, name: str, **plan: object) -> str:
        """Create a tenant with ``plan``; return a key of it."""
        with self.admin as admin:
            created = admin.post("/admin/v1/tenants", json={"name": name, **plan})
            assert created.status_code == 201, created.text
            issued = admin.post(f"/admin/v1/tenants/{name}/keys", json={})
            assert issued.status_code == 201, issued.text
            self.issued_keys.append(issued.json()["key"])
            return self.issued_keys[-1]


LONG_PROMPT = "Summarize: " + "the quick brown fox jumps over the lazy dog " * 40
"""Long enough for the decider to split it across the prefill and decode workers."""


def traced_stream(live_stack: LiveStack, trace_id: str, parent_span: str) -> set[str]:
    """A disaggregated 8-token chat stream under the client span ``parent_span`` of
    ``trace_id`` (W3C ``traceparent``, sampled); the chunks' ids."""
    client = openai.OpenAI(base_url=f"{live_stack.base_url}/v1", api_key=live_stack.api_key)
    stream = client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=8,
        stream=True,
        extra_headers={"traceparent": f"00-{trace_id}-{parent_span}-01"},
    )
    return {chunk.id for chunk in stream}


def counting_stream(
    client: openai.OpenAI, live_stack: LiveStack, max_tokens: int
) -> openai.Stream[Any]:
    """A chat stream that only ``max_tokens`` or an abort ends (vLLM's ``ignore_eos``)."""
    return client.chat.completions.create(
        model=live_stack.model,
        messages=[{"role": "user", "content": "Count from one to five hundred in words."}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def ledger_rows(live_stack: LiveStack, tenant: str | None = None) -> list[dict[str, str]]:
    """The ledger's per-request rows of this session (of ``tenant`` only, if given), in the
    store's order; the export flushes pending records first."""
    today = datetime.now(UTC).date()
    params = {"from": str(today - timedelta(days=1)), "to": str(today + timedelta(days=2)),
              "kind": "requests", "format": "csv"}  # fmt: skip
    if tenant is not None:
        params["tenant"] = tenant
    with live_stack.admin as admin:
        response = admin.get("/admin/v1/billing/export", params=params, timeout=60)
    assert response.status_code == 200, response.text
    return list(csv.DictReader(io.StringIO(response.text)))


def worker_gauge(worker_url: str, name: str) -> float:
    """A gauge from a vLLM worker's ``/metrics`` (e.g. ``vllm:kv_cache_usage_perc``)."""
    text = httpx.get(f"{worker_url}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}}\s+([0-9.e+-]+)$", text, re.M)
    assert found, f"{worker_url}/metrics has no {name}"
    return float(found.group(1))


def model_processes(live_stack: LiveStack) -> list[psutil.Process]:
    """The stack's ``VLLM::Worker`` processes: each vLLM server spawns one, and the model runs
    on its main thread."""
    return [
        p
        for p in psutil.Process(live_stack.pid).children(recursive=True)
        if p.name() == "VLLM::Worker"
    ]


def server_env(worker: psutil.Process, name: str) -> str | None:
    """``name`` as Tandem set it for the vLLM server above ``worker`` (vLLM's engine does not
    pass every variable on to the worker process it spawns); None where it is unset."""
    for process in [worker, *worker.parents()]:
        value = process.environ().get(name)
        if value is not None:
            return value
    return None


def _write_profile(path: Path) -> Path:
    """The bundled model's worker as ``tandem profile`` measured it on a 2-core host (eager):
    prefill 256 to 621 prompt tokens/s for 128 to 900-token prompts; ITL 70 to 147 ms for 1 to
    16 streams."""
    Profile(
        "e2e",
        (PrefillPoint(128, 256.0), PrefillPoint(900, 621.0)),
        (DecodePoint(1, 0.070), DecodePoint(16, 0.147)),
    ).save(path)
    return path


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """Where the stack's gateway and vLLM workers export their spans (tests/e2e/test_tracing.py)."""
    with receiver_in_thread() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def live_stack(
    tmp_path_factory: pytest.TempPathFactory, otlp_receiver: OtlpReceiver
) -> Iterator[LiveStack]:
    base = free_port_block(8)  # test_zz_faults.py kills and restarts the workers
    workdir = tmp_path_factory.mktemp("stack")
    env = {
        **os.environ,
        "TANDEM_PORT": str(base),
        "TANDEM_PREFILL_BASE_PORT": str(base + 1),
        "TANDEM_DECODE_BASE_PORT": str(base + 2),
        "TANDEM_SIDE_CHANNEL_BASE_PORT": str(base + 3),
        "TANDEM_ENFORCE_EAGER": "true",  # boots in about half the time; tests need no speed
        "TANDEM_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "TANDEM_DEFAULT_MAX_TOKENS": str(DEFAULT_MAX_TOKENS),
        "TANDEM_LOG_DIR": str(workdir / "logs"),
        "TANDEM_STATE_DIR": str(workdir / "state"),
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        # Issue 19's flood (test_noisy_neighbours.py): 8 in flight, so the heavy tenants queue
        # and fair admission decides who runs; at its 1/4 share the weight-1 tenant's 24
        # streams queue about a minute each, past the default 60 s queue timeout.
        "TANDEM_MAX_IN_FLIGHT_PER_WORKER": "8",
        "TANDEM_QUEUE_TIMEOUT_S": "300",
        # Issue 21's rollouts (test_rollouts.py): bakes of seconds want fine windows and cost
        # samples, and a price per worker for the cost gate.
        "TANDEM_ROLLOUT_WINDOW_BUCKET_S": "1",
        "TANDEM_TELEMETRY_INTERVAL_S": "1",
        "TANDEM_WORKER_COST_PER_HOUR": "1.0",
        # Issue 22's traces (test_tracing.py): every request, exported within a fraction of a
        # second, by the gateway and by both workers.
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_receiver.url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        # Issue 23's planner (test_planner.py): local workers, paused until that test resumes
        # it (the other tests keep one prefill and one decode worker), short intervals and
        # windows so a burst scales up and its end scales back down within minutes.
        "TANDEM_PLANNER": "local",
        "TANDEM_PLANNER_PAUSED": "true",
        "TANDEM_PLANNER_PROFILE": str(_write_profile(workdir / "profile.json")),
        "TANDEM_PLANNER_INTERVAL_S": "3",
        "TANDEM_PLANNER_TTFT_TARGET_S": "5",
        "TANDEM_PLANNER_PREFILL_MIN_REPLICAS": "1",
        "TANDEM_PLANNER_PREFILL_MAX_REPLICAS": "2",
        "TANDEM_PLANNER_DECODE_MIN_REPLICAS": "1",
        "TANDEM_PLANNER_DECODE_MAX_REPLICAS": "1",
        "TANDEM_PLANNER_DOWN_WINDOW_S": "20",
        "TANDEM_PLANNER_COOLDOWN_S": "10",
        "TANDEM_PLANNER_DRAIN_TIMEOUT_S": "60",
        "TANDEM_PLANNER_MAX_WORKERS": "3",
    }
    log_path = workdir / "tandem-up.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "tandem"), "up"], env=env, stdout=log, stderr=log
        )
    gateway = f"http://127.0.0.1:{base}"
    try:
        ready = _wait_ready(gateway, process, log_path)
    except BaseException:
        process.kill()
        raise
    workers = {w["role"]: w["url"] for w in ready["workers"]}
    stack = LiveStack(gateway, "", workers["prefill"], workers["decode"], MAX_MODEL_LEN, "")
    api_key = stack.new_tenant("e2e")
    models = httpx.get(f"{gateway}/v1/models", headers={"Authorization": f"Bearer {api_key}"})
    model = models.json()["data"][0]["id"]
    [version] = ready["versions"]
    yield LiveStack(
        gateway, model, workers["prefill"], workers["decode"], MAX_MODEL_LEN, api_key,
        log_dir=workdir / "logs", pid=process.pid, version=version,
        issued_keys=stack.issued_keys,
    )  # fmt: skip

    # Collected now, not at boot: workers restarted during the session must not linger either.
    descendants = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=90)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"tandem up did not stop within 90 s of SIGTERM; log: {log_path}")
    alive = [p for p in descendants if _alive(p)]
    for leftover in alive:
        leftover.kill()
    assert process.returncode == 0, f"tandem up exited with {process.returncode}; log: {log_path}"
    assert not alive, f"orphans left after SIGTERM: {[p.pid for p in alive]}"
    _assert_clean_worker_shutdowns(workdir / "logs")


SHUTDOWN_START = "[shutdown] API server: shutdown triggered"


def _assert_clean_worker_shutdowns(log_dir: Path) -> None:
    """Each worker's last shutdown (the one ``tandem up`` asked for) logs as clean: vLLM stopped
    its engine in order, no traceback (earlier ones may come from the fault tests' kills)."""
    logs = sorted(log_dir.glob("*.log"))
    assert logs, f"no worker logs in {log_dir}"
    for path in logs:
        text = path.read_text(errors="replace")
        assert SHUTDOWN_START in text, f"{path.name}: the worker was not asked to shut down"
        last = text[text.rindex(SHUTDOWN_START) :]
        assert "engine client stopped" in last, f"{path.name}: engine not stopped in order"
        for sign in ("Traceback", "EngineDeadError", "force kill"):
            assert sign not in last, f"{path.name}: {sign!r} in a clean shutdown:\n{last[:3000]}"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_ready(gateway: str, process: subprocess.Popen[bytes], log_path: Path) -> dict[str, Any]:
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tandem up exited with {process.returncode}:\n{_tail(log_path)}")
        try:
            response = httpx.get(f"{gateway}/ready", timeout=2)
            if response.status_code == 200:
                return dict(response.json())
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"stack not ready after {BOOT_TIMEOUT_S:.0f} s:\n{_tail(log_path)}")


def _tail(path: Path, num_lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


_NOTABLE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Any:
    """A failed e2e test's report carries the stack's last warnings and errors: CI keeps only
    pytest's output, and the stack's working directory goes with the machine."""
    report = yield
    stack = getattr(item, "funcargs", {}).get("live_stack")
    if report.failed and isinstance(stack, LiveStack) and stack.log_dir is not None:
        log_path = stack.log_dir.parent / "tandem-up.log"
        if log_path.exists():
            lines = log_path.read_text(errors="replace").splitlines()
            notable = [line for line in lines if _NOTABLE.search(line)][-60:]
            report.sections.append(
                (f"tandem up's last warnings and errors ({log_path})", "\n".join(notable))
            )
    return report


@pytest.fixture(scope="session")
def client(live_stack: LiveStack) -> openai.OpenAI:
    # max_retries=0: a test must see the first answer, not a retried one.
    return openai.OpenAI(
        base_url=f"{live_stack.base_url}/v1", api_key=live_stack.api_key, max_retries=0
    )
