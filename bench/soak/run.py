"""One soak: the stack up, tenants made, load and faults for the run's minutes, then the idle
stack inspected, a graceful shutdown under open streams, the ledger read, every check run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
from prometheus_client.parser import text_string_to_metric_families

from bench.harness.workload import Target
from bench.soak.check import Check, Evidence, IdleState, LedgerRow, Shutdown, check_all
from bench.soak.faults import RECOVERY_TIMEOUT_S, Fault, FaultKind, run_faults
from bench.soak.load import PROBE, TENANTS, Load, Sent, SoakTenant, probe_until_ok
from bench.soak.stack import SoakStack, StackSpec, running_stack

IDLE_SETTLE_S = 30.0
"""How long the idle stack may take to show zero in flight and its KV back where it was
(gauges refresh every second). KV a decode leg never read (a gateway killed between the
legs) is freed when its lease ends (``TANDEM_KV_LEASE_S``, 10 s by default): a block still
held after this long has leaked."""
DRAIN = SoakTenant("steady", {}, clients=4, long_prompts=False, max_tokens=48)
"""The streams open when ``tandem up`` gets SIGTERM (the steady tenant's key)."""


@dataclass(frozen=True, slots=True)
class SoakSpec:
    workdir: Path
    minutes: float = 20.0
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    gap_s: float = 10.0
    """Quiet time before each fault (after the previous one recovered)."""
    request_timeout_s: float = 90.0
    """Every client's deadline: a request still open past it counts as hung."""


@dataclass
class SoakResult:
    spec: SoakSpec
    seconds: float
    sent: list[Sent]
    faults: list[Fault]
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)


async def run_soak(spec: SoakSpec) -> SoakResult:
    started = time.monotonic()
    stack_spec = StackSpec(workdir=spec.workdir)
    async with running_stack(stack_spec) as stack:
        keys = {t.name: await stack.new_tenant(t.name, t.plan) for t in (*TENANTS, PROBE)}
        target = Target(
            stack.base_url, await stack.served_model(keys[PROBE.name]),
            timeout_s=spec.request_timeout_s,
        )  # fmt: skip
        async with Load(target, keys, time.perf_counter()) as load:
            for tenant in (PROBE, *TENANTS):  # warm both paths (colocated and split) first
                await load.one(tenant, "probe")
            if await probe_until_ok(load, load.now(), 120) is None:
                raise RuntimeError(f"the fresh stack answers no request: see {stack.log_path}")
            kv_baseline = await _worker_gauges(stack, "vllm:kv_cache_usage_perc")
            rss_before = stack.gateway_rss()
            load.start(TENANTS)
            until_s = load.now() + spec.minutes * 60
            faults = await run_faults(stack, load, spec.kinds, until_s, spec.gap_s)
            await asyncio.sleep(max(0.0, until_s - load.now()))  # faults ended early
            await load.stop()
            await stack.wait_ready(RECOVERY_TIMEOUT_S)
            idle = await _idle_state(stack, kv_baseline)
            rss_after = stack.gateway_rss()
            shutdown = await _shutdown_under_streams(stack, load, stack_spec.shutdown_grace_s)
        ledger = await asyncio.to_thread(_read_ledger, stack.ledger_url)
    evidence = Evidence(
        sent=load.sent,
        faults=faults,
        ledger=ledger,
        idle=idle,
        kv_baseline=kv_baseline,
        rss_before=rss_before,
        rss_after=rss_after,
        shutdown=shutdown,
        tpm={t.name: int(t.plan["tpm"]) for t in TENANTS if "tpm" in t.plan},
        max_tokens={t.name: t.max_tokens for t in (*TENANTS, PROBE)},
        kinds=spec.kinds,
    )
    return SoakResult(spec, time.monotonic() - started, load.sent, faults, check_all(evidence))


async def _idle_state(stack: SoakStack, kv_baseline: dict[str, float]) -> IdleState:
    """What the idle stack holds, once nothing is in flight and each worker's KV usage is
    back to ``kv_baseline`` (or after ``IDLE_SETTLE_S``)."""
    deadline = time.monotonic() + IDLE_SETTLE_S
    while True:
        in_flight = queued = 0.0
        async with httpx.AsyncClient(timeout=10) as client:
            for process in stack.gateway_processes():
                text = (await client.get(f"{process['url']}/metrics")).text
                in_flight += _sum(text, "tandem_admission_in_flight")
                queued += _sum(text, "tandem_admission_queued")
        running = await _worker_gauges(stack, "vllm:num_requests_running")
        kv_usage = await _worker_gauges(stack, "vllm:kv_cache_usage_perc")
        idle = IdleState(in_flight, queued, running, kv_usage)
        kv_back = all(v <= kv_baseline.get(role, 0.0) for role, v in kv_usage.items())
        settled = in_flight == 0 and queued == 0 and not any(running.values()) and kv_back
        if settled or time.monotonic() > deadline:
            return idle
        await asyncio.sleep(1)


async def _worker_gauges(stack: SoakStack, name: str) -> dict[str, float]:
    """Each worker's gauge ``name`` (summed over its series), by role."""
    gauges = {}
    async with httpx.AsyncClient(timeout=10) as client:
        for role, url in stack.worker_urls.items():
            gauges[role] = _sum((await client.get(f"{url}/metrics")).text, name)
    return gauges


def _sum(text: str, name: str) -> float:
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    )


async def _shutdown_under_streams(stack: SoakStack, load: Load, grace_s: float) -> Shutdown:
    """SIGTERM to ``tandem up`` once ``DRAIN.clients`` streams have their first token: they
    must finish, be billed, and ``tandem up`` exit 0."""
    first = len(load.sent)
    streams = [asyncio.create_task(load.one(DRAIN, "drain")) for _ in range(DRAIN.clients)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        opened = [s for s in load.sent[first:] if s.first_token_s is not None or s.done]
        if len(opened) == DRAIN.clients:
            break
        await asyncio.sleep(0.05)
    exit_code, seconds = await stack.stop(grace_s + 45)
    drained = await asyncio.gather(*streams)
    return Shutdown(exit_code, seconds, grace_s, list(drained))


def _read_ledger(url: str) -> list[LedgerRow]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT record_id, request_id, status, prompt_tokens, completion_tokens, "
            "started_at_us, ttft_us, e2e_us FROM tandem_usage"
        ).fetchall()
    return [
        LedgerRow(
            str(a),
            str(b),
            str(c),
            int(d),
            int(e),
            int(f),
            None if g is None else int(g),
            0 if h is None else int(h),
        )
        for a, b, c, d, e, f, g, h in rows
    ]
