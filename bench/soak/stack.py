"""The soak's real stack, and the faults it can suffer.

The soak owns its Redis (``gateway.assembly.redis_server.OwnedRedis``: append-only file, so a
restart keeps tenants and keys as a production Redis would) and its PostgreSQL (a throwaway
cluster from ``tests.postgres_server``, as ``bench.ledger`` uses), so it can stop and start
them. ``tandem up`` runs over both with two gateway processes on one port, one prefill and one
decode vLLM CPU worker, quotas failing closed (a tenant's bound holds through a Redis outage:
503 ``store_unavailable`` meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from gateway.assembly.redis_server import OwnedRedis
from tests.server_process import free_port_block

BOOT_TIMEOUT_S = 900.0
PORT_BLOCK = 8
"""The gateway's port, then the workers' HTTP and side-channel ports count up from it."""
LOG_TAIL_LINES = 40
"""How much of each log a StackError carries."""


class StackError(RuntimeError):
    """The stack did not start, or stopped answering for longer than a fault allows."""


@dataclass(frozen=True, slots=True)
class StackSpec:
    workdir: Path
    gateway_processes: int = 2
    max_model_len: int = 1024
    queue_timeout_s: float = 20.0
    """Short, so requests waiting for a dead decode worker fail cleanly within a client's
    deadline instead of queueing past it."""
    shutdown_grace_s: int = 30
    max_in_flight_per_worker: int = 8


class SoakStack:
    """Redis, PostgreSQL and ``tandem up`` over them; every fault the soak injects."""

    def __init__(self, spec: StackSpec) -> None:
        self.spec = spec
        self.admin_key = secrets.token_urlsafe(24)
        self.port = free_port_block(PORT_BLOCK)
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.redis = OwnedRedis(spec.workdir / "redis")
        self.ledger_url = ""
        self.worker_urls: dict[str, str] = {}
        """Each role's worker URL (one worker per role), once started."""
        self.log_path = spec.workdir / "tandem-up.log"
        self._postgres: Any = None
        self._process: asyncio.subprocess.Process | None = None
        self._resources = contextlib.ExitStack()

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    @property
    def worker_log_dir(self) -> Path:
        return self.spec.workdir / "logs"

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    async def start(self) -> None:
        """Start Redis, PostgreSQL and ``tandem up``; return once every worker is healthy."""
        # Imported here, as bench.ledger does: the test suite's throwaway cluster, not a copy.
        from tests.postgres_server import running_postgres

        self.spec.workdir.mkdir(parents=True, exist_ok=True)
        await self.redis.start()
        self._postgres = self._resources.enter_context(running_postgres())
        self.ledger_url = self._postgres.create_database("tandem_soak")
        with self.log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).parent / "tandem"), "up",
                env=self._env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        ready = await self.wait_ready(BOOT_TIMEOUT_S)
        await self._wait_for_process_list(BOOT_TIMEOUT_S)
        # A restarted worker keeps its name and port, and the planner is off: these hold for
        # the whole run, and need no gateway to answer (one may be the fault).
        self.worker_urls = {str(w["role"]): str(w["url"]) for w in ready["workers"]}

    def _env(self) -> dict[str, str]:
        spec = self.spec
        return {
            **os.environ,
            "TANDEM_PORT": str(self.port),
            # The workers are killed and restarted on these: ports no outbound connection takes.
            "TANDEM_PREFILL_BASE_PORT": str(self.port + 1),
            "TANDEM_DECODE_BASE_PORT": str(self.port + 2),
            "TANDEM_SIDE_CHANNEL_BASE_PORT": str(self.port + 3),
            "TANDEM_GATEWAY_WORKERS": str(spec.gateway_processes),
            "TANDEM_REDIS_URL": self.redis.url,
            "TANDEM_BILLING_DATABASE_URL": self.ledger_url,
            "TANDEM_QUOTA_STORE_FAILURE": "closed",
            "TANDEM_ADMIN_KEY": self.admin_key,
            "TANDEM_ENFORCE_EAGER": "true",  # boots (and restarts) in about half the time
            "TANDEM_MAX_MODEL_LEN": str(spec.max_model_len),
            "TANDEM_QUEUE_TIMEOUT_S": str(spec.queue_timeout_s),
            "TANDEM_SHUTDOWN_GRACE_S": str(spec.shutdown_grace_s),
            "TANDEM_MAX_IN_FLIGHT_PER_WORKER": str(spec.max_in_flight_per_worker),
            "TANDEM_LOG_DIR": str(self.worker_log_dir),
            "TANDEM_STATE_DIR": str(spec.workdir / "state"),
        }

    async def _wait_for_process_list(self, timeout_s: float) -> None:
        """Until ``tandem up`` lists its gateway processes: process 0 answers ``/ready``
        before the others have started, and the list is written once they have (a CI run read
        it in between and found no file)."""
        path = self._process_list_path
        deadline = time.monotonic() + timeout_s
        while self.spec.gateway_processes > 1 and not path.exists():
            if self._process is not None and self._process.returncode is not None:
                raise StackError(f"tandem up exited while starting: see {self.log_path}")
            if time.monotonic() > deadline:
                raise StackError(
                    f"tandem up did not list its gateway processes within {timeout_s:.0f} s: "
                    f"see {self.log_path}"
                )
            await asyncio.sleep(0.1)

    @property
    def _process_list_path(self) -> Path:
        return self.spec.workdir / "state" / "gateway-processes.json"

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """``/ready``'s body once every worker is healthy; StackError past ``timeout_s``, saying
        what was seen last and ending with the end of each log (CI keeps no files).

        Every known worker must also answer its own ``/health``: the gateway's view of one
        lags by up to a health interval, so ``/ready`` said 200 for a worker killed just
        before (CI read the prefill worker's metrics next and found nothing listening)."""
        deadline = time.monotonic() + timeout_s
        last_seen = "nothing yet"
        async with httpx.AsyncClient(timeout=2) as client:
            while time.monotonic() < deadline:
                if self._process is not None and self._process.returncode is not None:
                    raise StackError(
                        f"tandem up exited with {self._process.returncode}: see {self.log_path}"
                        f"{self._log_tail()}"
                    )
                try:
                    response = await client.get(f"{self.base_url}/ready")
                    if response.status_code != 200:
                        last_seen = f"/ready answered {response.status_code}: {response.text}"
                    elif (silent := await self._silent_worker(client)) is not None:
                        last_seen = f"/ready answered 200, but {silent}"
                    else:
                        return dict(response.json())
                except httpx.HTTPError as exc:
                    last_seen = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(0.5)
        raise StackError(
            f"the stack was not ready within {timeout_s:.0f} s; last seen: {last_seen}; "
            f"see {self.log_path}{self._log_tail()}"
        )

    async def _silent_worker(self, client: httpx.AsyncClient) -> str | None:
        """Which known worker does not answer its own ``/health`` (None: all do)."""
        for role, url in self.worker_urls.items():
            try:
                status = (await client.get(f"{url}/health")).status_code
            except httpx.HTTPError as exc:
                return f"the {role} worker's /health failed: {type(exc).__name__}: {exc}"
            if status != 200:
                return f"the {role} worker's /health answered {status}"
        return None

    def _log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The end of ``tandem up``'s log less its per-request lines, then the end of each
        worker's log: what an error CI prints needs (CI keeps no files)."""
        parts = []
        sources = [(self.log_path, "tandem up"), *((p, p.stem) for p in self._worker_logs())]
        for path, name in sources:
            try:
                text = path.read_text(errors="replace").splitlines()
            except OSError as exc:
                parts.append(f"--- {name}: no log ({exc}) ---")
                continue
            kept = [line for line in text if " tandem.requests: " not in line][-lines:]
            parts.append(f"--- the end of {name}'s log ({path}) ---\n" + "\n".join(kept))
        return "\n" + "\n".join(parts)

    def _worker_logs(self) -> list[Path]:
        return sorted(self.worker_log_dir.glob("*.log"))

    async def new_tenant(self, name: str, plan: dict[str, Any]) -> str:
        """Create tenant ``name`` with ``plan``; return a key of it."""
        async with httpx.AsyncClient(
            base_url=self.base_url, headers=self.admin_headers, timeout=10
        ) as admin:
            created = await admin.post("/admin/v1/tenants", json={"name": name, **plan})
            if created.status_code != 201:
                raise StackError(f"creating tenant {name}: {created.status_code} {created.text}")
            issued = await admin.post(f"/admin/v1/tenants/{name}/keys", json={})
            if issued.status_code != 201:
                raise StackError(f"a key for {name}: {issued.status_code} {issued.text}")
            return str(issued.json()["key"])

    async def served_model(self, api_key: str) -> str:
        async with httpx.AsyncClient(timeout=10) as client:
            models = await client.get(
                f"{self.base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}
            )
            return str(models.json()["data"][0]["id"])

    # What runs, found where the stack publishes it.

    def gateway_processes(self) -> list[dict[str, Any]]:
        """Each gateway process's index, pid and own URL (``gateway-processes.json``)."""
        return list(json.loads(self._process_list_path.read_text())["processes"])

    def gateway_rss(self) -> dict[int, tuple[int, int]]:
        """Each gateway process's index -> (pid, RSS bytes); the gone ones are left out."""
        rss: dict[int, tuple[int, int]] = {}
        for entry in self.gateway_processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                rss[int(entry["index"])] = (
                    int(entry["pid"]),
                    psutil.Process(int(entry["pid"])).memory_info().rss,
                )
        return rss

    # Faults.

    async def restart_redis(self, down_s: float) -> None:
        await self.redis.aclose()
        await asyncio.sleep(down_s)
        await self.redis.start()

    async def restart_postgres(self, down_s: float) -> None:
        await asyncio.to_thread(self._postgres.stop)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(self._postgres.start)

    def kill_worker(self, url: str) -> None:
        """SIGKILL the process group of the vLLM server listening at ``url`` (a crash)."""
        os.killpg(os.getpgid(_listener_pid(url)), signal.SIGKILL)

    def signal_worker(self, url: str, signum: signal.Signals) -> None:
        os.killpg(os.getpgid(_listener_pid(url)), signum)

    def kill_gateway_process(self, index: int) -> int:
        """SIGKILL gateway process ``index`` (``tandem up`` restarts it); its pid."""
        [entry] = [e for e in self.gateway_processes() if int(e["index"]) == index]
        pid = int(entry["pid"])
        os.kill(pid, signal.SIGKILL)
        return pid

    async def stop(self, timeout_s: float) -> tuple[int | None, float]:
        """SIGTERM to ``tandem up``: (its exit code, None if it had to be killed; seconds)."""
        process = self._process
        assert process is not None
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            code: int | None = await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            code = None
        return code, time.monotonic() - started

    async def aclose(self) -> None:
        """Whatever still runs is stopped: ``tandem up`` and its children, Redis, PostgreSQL."""
        process = self._process
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        await self.redis.aclose()
        self._resources.close()


@contextlib.asynccontextmanager
async def running_stack(spec: StackSpec) -> AsyncIterator[SoakStack]:
    stack = SoakStack(spec)
    try:
        await stack.start()
        yield stack
    finally:
        await stack.aclose()


def _listener_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    pids = {
        conn.pid
        for conn in psutil.net_connections("tcp")
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN
    }
    if len(pids) != 1 or None in pids:
        raise StackError(f"expected one process listening on port {port}, found {pids}")
    return int(next(iter(pids)))  # type: ignore[arg-type]
