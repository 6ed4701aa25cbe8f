"""The two kinds of overhead run: against fast fake engines (the servers started here, pinned),
and against a real stack someone else runs.

Fake run, per target in turn (``direct``, ``relay`` (a bare SSE relay: the floor),
``tandem-2leg``, ``tandem-colocated``, ``tandem-2proc`` (two processes over the Redis ``tandem up``
starts), ``tandem-redis`` (one process over a Redis started here, on this process's core: what
the shared stores cost a request), ``tandem-moderated``, ``tandem-policy`` (two legs, through a
sticky policy over two versions), ``litellm``):
start its server on the server core, run every concurrency level, then, for servers, a
1-token level (the fixed cost per request, for the per-chunk split), the profiled level (first
Tandem target only) and the check of which serving path the gateway counted; stop the server.
The load generator and the fake engines share the other core, as when the anchors in
``measure.ANCHORS`` were measured.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench.harness.client import served_model
from bench.harness.workload import Api, Target, TenantSpec
from bench.overhead.fake_vllm import Timing
from bench.overhead.load import CpuReader, LoadSpec, idle_cpu_rate, run_level
from bench.overhead.measure import Cost, LevelResult, fit_cost
from bench.overhead.procs import (
    Server,
    process_tree_cpu_times,
    start_fake_engine,
    usable_cores,
)
from bench.overhead.profile import Profile, PySpy
from bench.overhead.servers import (
    LITELLM_MASTER_KEY,
    TandemSetup,
    gateway_paths,
    start_litellm,
    start_relay,
    start_tandem,
)
from gateway.assembly.redis_server import OwnedRedis

MODEL = "fake-model"
SERVER_CORE, ENGINE_CORE = 1, 0


@dataclass(slots=True)
class FakeRunConfig:
    levels: Sequence[int]
    spec: LoadSpec
    timing: Timing
    targets: Sequence[str]
    auth: bool = True
    litellm: Path | None = None
    profile: Path | None = None
    profile_concurrency: int = 64
    fit_concurrency: int | None = 64
    fake_check: bool = True
    pin: bool = True
    py_spy: Path = Path(".venv/bin/py-spy")
    keep_work_dir: bool = False
    idle_s: float = 5.0
    """How long each server's idle CPU rate is measured before its load."""
    tokenizer_dir: Path | None = None
    """Tandem counts prompts with this folder's ``tokenizer.json`` (None: 4 characters a
    token)."""


@dataclass(slots=True)
class RunOutput:
    pinned: bool = False
    """Server on ``SERVER_CORE``, load generator and engines on ``ENGINE_CORE``."""
    results: list[LevelResult] = field(default_factory=list)
    extra: list[LevelResult] = field(default_factory=list)
    """Levels that are not part of the comparison: 1-token fits, the profiled run, the check."""
    fits: dict[str, Cost] = field(default_factory=dict)
    paths: dict[str, dict[str, float]] = field(default_factory=dict)
    engine_stats: dict[str, Any] = field(default_factory=dict)
    profile: Profile | None = None
    notes: list[str] = field(default_factory=list)


def say(console: Console, result: LevelResult, label: str = "") -> None:
    """One line per level: requests, errors, rate, TTFT p50, ITL p99, the server's CPU."""
    s, ttft, itl = result.summary, result.summary.metrics["ttft"], result.summary.metrics["itl"]
    cpu = result.cpu_ms_per_request
    console.print(
        f"  {result.target}{label} c={result.concurrency}: {s.sent} req, {s.failed} failed, "
        f"{s.request_throughput:.1f} req/s, TTFT p50 {ttft.p50 if ttft else float('nan'):.2f} ms, "
        f"ITL p99 {itl.p99 if itl else float('nan'):.2f} ms"
        + (f", server CPU {cpu:.3f} ms/req" if cpu is not None else "")
    )


def pin_load_generator(pin: bool) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """The server's and the engines' cores (None: not pinned, by choice or for want of the
    cores); this process, the load generator, moves to the engines' core."""
    server_cores = usable_cores({SERVER_CORE}) if pin else None
    engine_cores = usable_cores({ENGINE_CORE}) if pin else None
    if engine_cores is not None:
        os.sched_setaffinity(0, engine_cores)
    return server_cores, engine_cores


async def run_fake(config: FakeRunConfig, console: Console) -> RunOutput:
    """Start the fakes, measure every target, stop everything (also on errors)."""
    out = RunOutput()
    server_cores, engine_cores = pin_load_generator(config.pin)
    out.pinned = server_cores is not None and engine_cores is not None
    out.notes.append(
        f"pinning: server under test on core {SERVER_CORE}, load generator + fake engines on "
        f"core {ENGINE_CORE}"
        if out.pinned
        else "pinning: none (--no-pin, or the cores are not there)"
    )
    work_dir = Path(tempfile.mkdtemp(prefix="tandem-overhead-"))
    engines: list[Server] = []
    try:
        for role in ("prefill", "decode"):
            engines.append(
                start_fake_engine(f"fake-{role}", config.timing, MODEL, work_dir, engine_cores)
            )
        prefill, decode = engines

        def engine_cpu() -> tuple[float, float]:
            times = [engine.cpu_times() for engine in engines]
            return sum(t[0] for t in times), sum(t[1] for t in times)

        for name in config.targets:
            async with _shared_stores(name, work_dir) as redis_url:
                await _run_target(
                    name, config, out, console, prefill, decode, work_dir, server_cores,
                    engine_cpu, redis_url,
                )  # fmt: skip
        if config.fake_check and engine_cores and server_cores:
            await _fake_check(config, out, console, decode, engine_cpu, server_cores)
        async with httpx.AsyncClient(timeout=5) as client:
            for engine in engines:
                stats = (await client.get(engine.url + "/_fake/stats")).json()
                stats.pop("last_bodies", None)
                out.engine_stats[engine.name] = stats
    finally:
        for engine in engines:
            engine.stop()
        if config.keep_work_dir:
            console.print(f"logs and state kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    return out


async def _run_target(
    name: str,
    config: FakeRunConfig,
    out: RunOutput,
    console: Console,
    prefill: Server,
    decode: Server,
    work_dir: Path,
    cores: frozenset[int] | None,
    engine_cpu: CpuReader,
    redis_url: str | None,
) -> None:
    server: Server | None = None
    api_key: str | None = None
    if name.startswith("tandem-"):
        setup = TandemSetup(
            two_legs=name in ("tandem-2leg", "tandem-policy"),
            traffic_policy=name == "tandem-policy",
            output_moderation=name == "tandem-moderated",
            auth=config.auth,
            max_in_flight_per_worker=max(4096, 2 * max(config.levels)),
            gateway_workers=2 if name == "tandem-2proc" else 1,  # tandem-colocated, 2 processes
            tokenizer_dir=config.tokenizer_dir,
            redis_url=redis_url,
        )
        server, api_key = start_tandem(setup, prefill.url, decode.url, MODEL, work_dir, cores)
    elif name == "relay":
        server = start_relay(decode.url, work_dir, cores)
    elif name == "litellm":
        if config.litellm is None:
            return
        server, api_key = (
            start_litellm(config.litellm, decode.url, MODEL, work_dir, cores),
            (LITELLM_MASTER_KEY),
        )
    elif name != "direct":
        raise ValueError(f"unknown target {name!r}")
    console.print(f"[bold]{name}[/]" + (f" (pid {server.pid}, {server.url})" if server else ""))
    target = Target(base_url=(server or decode).url, model=MODEL, api=Api.CHAT)
    tenant = TenantSpec(name="bench", api_key=api_key)
    server_cpu = server.cpu_times if server else None
    try:
        idle = await idle_cpu_rate(server.cpu_times, config.idle_s) if server else None
        rss_idle = server.rss_bytes() if server else None
        if idle is not None and rss_idle is not None:
            console.print(
                f"  idle CPU: {idle:.1f} ms/s (subtracted from the per-request figures), "
                f"RSS {rss_idle / 2**20:.1f} MiB"
            )

        async def level_run(concurrency: int, spec: LoadSpec) -> LevelResult:
            return await run_level(
                name, target, tenant, concurrency, spec, server_cpu, engine_cpu, idle,
                server.rss_bytes if server else None, rss_idle,
            )  # fmt: skip

        for level in config.levels:
            result = await level_run(level, config.spec)
            out.results.append(result)
            say(console, result)
        if server is None:
            return
        if config.fit_concurrency:
            short = dataclasses.replace(config.spec, num_tokens=1)
            one = await level_run(config.fit_concurrency, short)
            out.extra.append(dataclasses.replace(one, target=f"{name} (1 token)"))
            say(console, one, " (1 token)")
            full = next(
                (r for r in out.results if r.target == name and r.concurrency == one.concurrency),
                None,
            )
            if full is None:
                full = await level_run(one.concurrency, config.spec)
            fit = fit_cost(one, full)
            if fit is not None:
                out.fits[name] = fit
        if config.profile is not None and out.profile is None and name.startswith("tandem-"):
            with PySpy(
                config.py_spy, server.pid, config.profile, usable_cores({ENGINE_CORE})
            ) as spy:
                profiled = await level_run(config.profile_concurrency, config.spec)
            out.extra.append(dataclasses.replace(profiled, target=f"{name} (profiled)"))
            say(console, profiled, " (profiled)")
            out.profile = spy.read(str(Path.cwd()) + "/")
            console.print(f"  profile written to {config.profile} (py-spy log: {spy.log})")
        if name.startswith("tandem-"):
            out.paths[name] = gateway_paths(server.url)
    finally:
        if server is not None:
            server.stop()


@asynccontextmanager
async def _shared_stores(name: str, work_dir: Path) -> AsyncIterator[str | None]:
    """For ``tandem-redis``, a ``redis-server`` started as ``tandem up`` starts one for several
    gateway processes (``OwnedRedis``), and its URL; None for every other target."""
    if name != "tandem-redis":
        yield None
        return
    redis = OwnedRedis(work_dir / "tandem-redis-store")
    await redis.start()
    try:
        yield redis.url
    finally:
        await redis.aclose()


async def _fake_check(
    config: FakeRunConfig,
    out: RunOutput,
    console: Console,
    decode: Server,
    engine_cpu: CpuReader,
    generator_cores: frozenset[int],
) -> None:
    """The fake engine alone on its core at the highest level (load generator moved to the
    other core): can it keep its pace, and how much of a core does it need?"""
    level = max(config.levels)
    engine_cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, generator_cores)
    try:
        target = Target(base_url=decode.url, model=MODEL, api=Api.CHAT)
        result = await run_level(
            "direct", target, TenantSpec(name="bench"), level, config.spec, engine_cpu, None
        )
    finally:
        os.sched_setaffinity(0, engine_cores)
    out.extra.append(dataclasses.replace(result, target="fake engine alone (server = fakes)"))
    say(console, result, " (fake engine alone on its core)")


async def run_real(
    gateway_url: str,
    engine_url: str,
    api_key: str | None,
    pid: int | None,
    model: str | None,
    levels: Sequence[int],
    spec: LoadSpec,
    console: Console,
) -> RunOutput:
    """Direct to ``engine_url`` and through ``gateway_url``, level by level (A B, A B)."""
    out = RunOutput()
    out.notes.append("real stack: no pinning; engine CPU not measured")
    if model is None:
        model = await served_model(engine_url)
    # The gateway's own process only: `tandem up`'s children are its vLLM workers.
    server_cpu = (lambda: process_tree_cpu_times(pid, children=False)) if pid else None
    idle = None
    if server_cpu is None:
        out.notes.append("gateway CPU not reported (no --pid)")
    else:
        idle = await idle_cpu_rate(server_cpu, 5.0)
        console.print(f"  gateway idle CPU: {idle:.1f} ms/s (subtracted from per-request figures)")
    before = _paths_or_empty(gateway_url)
    for level in levels:
        for name, url, key, cpu in (
            ("direct", engine_url, None, None),
            ("tandem", gateway_url, api_key, server_cpu),
        ):
            target = Target(base_url=url, model=model, api=Api.CHAT)
            tenant = TenantSpec(name="bench", api_key=key)
            result = await run_level(
                name, target, tenant, level, spec, cpu, None, idle if cpu else None
            )
            out.results.append(result)
            say(console, result)
    after = _paths_or_empty(gateway_url)
    out.paths["tandem"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return out


def _paths_or_empty(url: str) -> dict[str, float]:
    try:
        return gateway_paths(url.rstrip("/"))
    except (httpx.HTTPError, ValueError):
        return {}
