"""Billing on vs off: the latency and gateway CPU that the ledger adds to a streamed request.

The gateway as ``bench.overhead`` starts it (``python -m gateway.cli up`` over external workers:
a tenant key with quotas, every request in two legs) in front of its fast fake engines, with
billing on (``TANDEM_BILLING=true``: the embedded SQLite ledger in the run's own state dir, its
spool, refresher and cost meter) or off (``TANDEM_BILLING=false``). Four runs, on, off, off, on
(A/B/B/A: a drift of the shared machine weighs on both arms alike), each on a fresh gateway with
fresh state. A run is one level of ``bench.overhead.load``: a warm-up, then ``requests / 2``
streamed chat requests, paced closed loop at the given concurrency, with the gateway's CPU net
of its idle rate. An arm's figure is the mean of its two runs' (percentiles are not pooled
across runs); the difference is on - off. Pinned as ``bench.overhead`` pins: gateway on core
1, fake engines and load generator on core 0.

With billing on, the ledger must hold one row per request sent (warm-up included) once the
gateway has stopped (it flushes on the way out): the count is read from the file and reported
next to what was sent. With billing off there must be no ledger file at all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from bench.harness.workload import Api, Target, TenantSpec
from bench.overhead.fake_vllm import Timing
from bench.overhead.load import LoadSpec, idle_cpu_rate, run_level
from bench.overhead.measure import LevelResult
from bench.overhead.procs import Server, start_fake_engine, usable_cores
from bench.overhead.runs import ENGINE_CORE, SERVER_CORE
from bench.overhead.servers import TandemSetup, start_tandem

MODEL = "fake-model"
ORDER = (True, False, False, True)
"""Billing on or off, run by run (A/B/B/A)."""
FIGURES = (
    "ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p90", "e2e_p99", "req_per_s",
    "cpu_ms_per_request",
)  # fmt: skip
"""What an arm reports (ms, requests per second, gateway CPU ms per request)."""
_BILLING_ENV = ("TANDEM_BILLING", "TANDEM_BILLING_DATABASE_URL")


@dataclass(frozen=True, slots=True)
class LatencySpec:
    """The load of every run."""

    num_requests: int = 2000
    """Measured requests per arm, half in each of its two runs."""
    concurrency: int = 16
    num_tokens: int = 16
    """Tokens each fake stream sends (billing costs per request, not per token: short streams
    give more requests per second)."""
    itl_s: float = 0.010
    """The fake engine's gap between tokens."""
    prompt_words: int = 100
    idle_s: float = 2.0
    """How long each gateway's idle CPU rate is measured before its load."""
    pin: bool = True


@dataclass(frozen=True, slots=True)
class RunResult:
    """One run: one gateway, billing on or off."""

    billing: bool
    level: LevelResult
    num_ledger_rows: int | None
    """Rows in the gateway's ledger after it stopped; None: no ledger file."""

    @property
    def num_sent(self) -> int:
        """Requests sent to this gateway, warm-up included (what the ledger must hold)."""
        return self.level.num_warmup + self.level.summary.sent

    def figures(self) -> dict[str, float | None]:
        metrics = self.level.summary.metrics
        ttft, e2e = metrics.get("ttft"), metrics.get("e2e")
        return {
            "ttft_p50": ttft.p50 if ttft else None,
            "ttft_p90": ttft.p90 if ttft else None,
            "ttft_p99": ttft.p99 if ttft else None,
            "e2e_p50": e2e.p50 if e2e else None,
            "e2e_p90": e2e.p90 if e2e else None,
            "e2e_p99": e2e.p99 if e2e else None,
            "req_per_s": self.level.summary.request_throughput,
            "cpu_ms_per_request": self.level.cpu_ms_per_request,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "billing": self.billing,
            "num_sent": self.num_sent,
            "num_ledger_rows": self.num_ledger_rows,
            "figures": self.figures(),
            "level": self.level.to_dict(),
        }


@dataclass(slots=True)
class LatencyOutput:
    runs: list[RunResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def arm(self, billing: bool) -> dict[str, float | None]:
        """The mean of the arm's runs, figure by figure."""
        return _mean([r.figures() for r in self.runs if r.billing is billing])

    def difference(self) -> dict[str, float | None]:
        """Billing on - billing off, figure by figure."""
        on, off = self.arm(True), self.arm(False)
        out: dict[str, float | None] = {}
        for name in FIGURES:
            a, b = on[name], off[name]
            out[name] = None if a is None or b is None else a - b
        return out


def _mean(rows: Sequence[dict[str, float | None]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name in FIGURES:
        values = [v for row in rows if (v := row[name]) is not None]
        out[name] = sum(values) / len(values) if values and len(values) == len(rows) else None
    return out


@contextlib.contextmanager
def billing_env(on: bool) -> Iterator[None]:
    """``start_tandem`` hands this process's environment to the gateway: billing is switched
    there, and a ``TANDEM_BILLING_DATABASE_URL`` of the caller's shell is kept out (the ledger
    under test is the embedded SQLite one)."""
    saved = {name: os.environ.get(name) for name in _BILLING_ENV}
    os.environ["TANDEM_BILLING"] = "true" if on else "false"
    os.environ.pop("TANDEM_BILLING_DATABASE_URL", None)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def ledger_rows(path: Path) -> int | None:
    """Rows of the SQLite ledger at ``path``; None when there is no such file."""
    if not path.exists():
        return None
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return int(connection.execute("SELECT COUNT(*) FROM tandem_usage").fetchone()[0])
    finally:
        connection.close()


async def run_latency(spec: LatencySpec, console: Console) -> LatencyOutput:
    """Start the fake engines, run the four gateways in turn, stop everything (also on errors)."""
    out = LatencyOutput()
    server_cores = usable_cores({SERVER_CORE}) if spec.pin else None
    engine_cores = usable_cores({ENGINE_CORE}) if spec.pin else None
    affinity = os.sched_getaffinity(0)
    if server_cores and engine_cores:
        os.sched_setaffinity(0, engine_cores)  # this process is the load generator
        out.notes.append(
            f"pinning: gateway on core {SERVER_CORE}, fake engines + load generator on core "
            f"{ENGINE_CORE}"
        )
    else:
        server_cores = engine_cores = None
        out.notes.append("pinning: none (--no-pin, or the cores are not there)")
    work_dir = Path(tempfile.mkdtemp(prefix="tandem-ledger-latency-"))
    engines: list[Server] = []
    try:
        timing = Timing(num_tokens=spec.num_tokens, itl_s=spec.itl_s)
        for role in ("prefill", "decode"):
            engines.append(start_fake_engine(f"fake-{role}", timing, MODEL, work_dir, engine_cores))

        def engine_cpu() -> tuple[float, float]:
            times = [engine.cpu_times() for engine in engines]
            return sum(t[0] for t in times), sum(t[1] for t in times)

        for index, billing in enumerate(ORDER, start=1):
            run_dir = work_dir / f"run{index}-billing-{'on' if billing else 'off'}"
            run_dir.mkdir()
            result = await _run_one(
                billing, spec, run_dir, engines[0].url, engines[1].url, server_cores, engine_cpu
            )
            out.runs.append(result)
            _say(console, index, result)
    finally:
        for engine in engines:
            engine.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
        os.sched_setaffinity(0, affinity)
    return out


async def _run_one(
    billing: bool,
    spec: LatencySpec,
    run_dir: Path,
    prefill_url: str,
    decode_url: str,
    cores: frozenset[int] | None,
    engine_cpu: Callable[[], tuple[float, float]],
) -> RunResult:
    setup = TandemSetup()
    with billing_env(billing):
        server, api_key = start_tandem(setup, prefill_url, decode_url, MODEL, run_dir, cores)
    per_run = max(1, spec.num_requests // 2)
    load = LoadSpec(
        prompt_words=spec.prompt_words,
        num_tokens=spec.num_tokens,
        min_requests=per_run,
        max_requests=per_run,
    )
    try:
        idle = await idle_cpu_rate(server.cpu_times, spec.idle_s)
        level = await run_level(
            f"billing {'on' if billing else 'off'}",
            Target(base_url=server.url, model=MODEL, api=Api.CHAT),
            TenantSpec(name="bench", api_key=api_key),
            spec.concurrency,
            load,
            server.cpu_times,
            engine_cpu,
            idle,
        )
    finally:
        server.stop()  # SIGTERM: the gateway flushes its ledger on the way out
    rows = ledger_rows(run_dir / setup.label / "ledger.db")
    return RunResult(billing, level, rows)


def _say(console: Console, index: int, run: RunResult) -> None:
    figures, summary = run.figures(), run.level.summary
    ledger = "no ledger" if run.num_ledger_rows is None else f"{run.num_ledger_rows} ledger rows"
    console.print(
        f"  run {index} billing {'on ' if run.billing else 'off'}: {summary.sent} req, "
        f"{summary.failed} failed, {summary.request_throughput:.1f} req/s, "
        f"TTFT p50 {_f(figures['ttft_p50'])} ms, E2E p50 {_f(figures['e2e_p50'])} ms, "
        f"CPU {_f(figures['cpu_ms_per_request'], 3)} ms/req; {ledger} for {run.num_sent} sent"
    )


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
