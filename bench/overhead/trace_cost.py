"""``python -m bench.overhead --tracing``: what request tracing costs the gateway's CPU.

Targets (issue 22): tracing off adds at most 1 % CPU per request, tracing on with every
request sampled at most 10 %.

*On*: two gateways over the same fake engines, both on the server core: ``tandem-2leg``
(tracing off) and ``tandem-traced``, the same setup exporting every request's spans
(``OTEL_TRACES_SAMPLER_ARG=1.0``, the batch processor's defaults) over OTLP/HTTP to a
receiver process (``python -m tests.otlp_receiver``) on the other core: a collector's CPU is
not the gateway's, and is reported apart. The two take turns at each level, round after round,
the order swapped every round (off-on, on-off, ...), so drift on a shared machine hits both
alike; each one's rounds are pooled (CPU and requests summed). Then the traced gateway is
stopped (its exporter flushes what it holds), then the receiver, which prints what it got: a
run whose receiver did not get every traced request's spans fails (a gateway that exports
nothing costs nothing, and would pass).

*Off*: no build without the tracing calls exists to compare with, so the calls one request
makes are timed directly (``trace_off``) and set against the gateway's measured CPU per
request with tracing off: that share is what tracing off adds.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from bench.harness.workload import Api, Target, TenantSpec
from bench.overhead.fake_vllm import Timing
from bench.overhead.load import LoadSpec, idle_cpu_rate, run_level
from bench.overhead.measure import Cost, LevelResult, Pooled, fit_cost, ratio
from bench.overhead.procs import (
    READY_TIMEOUT_S,
    Server,
    StartError,
    spawn,
    start_fake_engine,
)
from bench.overhead.runs import ENGINE_CORE, MODEL, SERVER_CORE, pin_load_generator, say
from bench.overhead.servers import TandemSetup, gateway_paths, start_tandem
from bench.overhead.trace_off import cpu_us_per_request

OFF, ON = "tandem-2leg", "tandem-traced"
MAX_ADDED_OFF, MAX_ADDED_ON = 0.01, 0.10
"""The targets: CPU per request added by tracing off, and by tracing on at 100 % sampling."""
GATEWAY_SPANS_PER_REQUEST = 8
"""One streamed, disaggregated request's spans from the gateway (telemetry/request_trace.py):
the root, ``tandem.authenticate``, ``tandem.moderation.input``, ``tandem.admission.queue``,
``tandem.prefill``, ``tandem.kv_transfer``, ``tandem.decode``, ``tandem.billing``."""
MIN_SPANS_RECEIVED = 0.95
"""Share of the expected spans the receiver must get; fewer means the exporter dropped spans
(the traced gateway did less than full tracing) or requests failed."""


class TracingRunError(RuntimeError):
    """The traced gateway's spans did not all reach the receiver: no figure for tracing on."""


@dataclass(frozen=True, slots=True)
class TracingRunConfig:
    levels: Sequence[int]
    spec: LoadSpec
    timing: Timing
    rounds: int = 3
    """Turns each gateway takes at every level."""
    auth: bool = True
    fit_concurrency: int | None = 64
    """1-token rounds at this level for the per-request/per-chunk split (None: none)."""
    pin: bool = True
    keep_work_dir: bool = False
    idle_s: float = 5.0
    """How long each gateway's idle CPU rate is measured before the rounds."""
    off_path_requests: int = 200_000
    """Requests' worth of tracing-off calls timed, per round of ``trace_off``."""


@dataclass(frozen=True, slots=True)
class SpanCount:
    """What the receiver got from the traced gateway."""

    received: int
    exports: int
    traced_requests: int
    """Requests sent to the traced gateway, warm-ups included."""

    @property
    def expected(self) -> int:
        return self.traced_requests * GATEWAY_SPANS_PER_REQUEST

    @property
    def per_request(self) -> float | None:
        return ratio(self.received, self.traced_requests)


def check_spans(count: SpanCount) -> None:
    """``TracingRunError`` unless the receiver got about every traced request's spans."""
    if count.received == 0:
        raise TracingRunError(
            f"the OTLP receiver got no span from {count.traced_requests} traced requests: the "
            "traced gateway did not trace (see its log), so tracing on was not measured"
        )
    if count.received < MIN_SPANS_RECEIVED * count.expected:
        raise TracingRunError(
            f"the OTLP receiver got {count.received} spans in {count.exports} exports, expected "
            f"{count.expected} ({GATEWAY_SPANS_PER_REQUEST} per request x "
            f"{count.traced_requests} requests): spans were dropped or requests failed, so the "
            "traced gateway's figure is not that of full tracing"
        )


@dataclass(frozen=True, slots=True)
class TracingCost:
    """Tracing's cost at one concurrency: the gateway's pooled rounds, off and on, and the CPU
    of the calls tracing off still makes."""

    concurrency: int
    off: Pooled
    on: Pooled
    off_path_us: float
    """CPU µs per request of the tracing calls with tracing off (``trace_off``)."""

    @property
    def added_on(self) -> float | None:
        """CPU per request with tracing on over tracing off, less 1 (0.05: 5 % more)."""
        increase = ratio(self.on.cpu_ms_per_request, self.off.cpu_ms_per_request)
        return None if increase is None else increase - 1

    @property
    def added_on_by_round(self) -> list[float]:
        """The same, round by round (its spread is the noise of the pooled figure)."""
        added = []
        for off, on in zip(self.off.runs, self.on.runs, strict=True):
            increase = ratio(on.cpu_ms_per_request, off.cpu_ms_per_request)
            if increase is not None:
                added.append(increase - 1)
        return added

    @property
    def added_off(self) -> float | None:
        """The tracing-off calls' share of the gateway's CPU per request with tracing off."""
        return ratio(self.off_path_us / 1000, self.off.cpu_ms_per_request)

    @property
    def on_holds(self) -> bool | None:
        return None if self.added_on is None else self.added_on <= MAX_ADDED_ON

    @property
    def off_holds(self) -> bool | None:
        return None if self.added_off is None else self.added_off <= MAX_ADDED_OFF

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "rounds": len(self.off.runs),
            "off_cpu_ms_per_request": self.off.cpu_ms_per_request,
            "on_cpu_ms_per_request": self.on.cpu_ms_per_request,
            "off_cpu_ms_per_chunk": self.off.cpu_ms_per_chunk,
            "on_cpu_ms_per_chunk": self.on.cpu_ms_per_chunk,
            "off_requests": self.off.num_requests,
            "on_requests": self.on.num_requests,
            "failed": self.off.num_failed + self.on.num_failed,
            "added_on": self.added_on,
            "added_on_by_round": self.added_on_by_round,
            "max_added_on": MAX_ADDED_ON,
            "on_holds": self.on_holds,
            "off_path_us_per_request": self.off_path_us,
            "added_off": self.added_off,
            "max_added_off": MAX_ADDED_OFF,
            "off_holds": self.off_holds,
        }


@dataclass(slots=True)
class TracingOutput:
    pinned: bool = False
    off_path_us: float = 0.0
    results: list[LevelResult] = field(default_factory=list)
    """Every round's full-length levels, labelled with their round."""
    extra: list[LevelResult] = field(default_factory=list)
    """The 1-token rounds (for the fits)."""
    costs: list[TracingCost] = field(default_factory=list)
    fits: dict[str, Cost] = field(default_factory=dict)
    spans: SpanCount | None = None
    receiver_cpu_s: float | None = None
    """The receiver's CPU over the whole run (decoding every export): not the gateway's."""
    paths: dict[str, dict[str, float]] = field(default_factory=dict)
    engine_stats: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


async def run_tracing(config: TracingRunConfig, console: Console) -> TracingOutput:
    """Time the off path, then run both gateways in turns; stop everything (also on errors).
    ``TracingRunError`` when the traced gateway's spans did not reach the receiver."""
    out = TracingOutput()
    server_cores, engine_cores = pin_load_generator(config.pin)
    out.pinned = server_cores is not None and engine_cores is not None
    out.notes.append(
        f"pinning: both gateways on core {SERVER_CORE}; load generator, fake engines and the "
        f"OTLP receiver on core {ENGINE_CORE}"
        if out.pinned
        else "pinning: none (--no-pin, or the cores are not there)"
    )
    console.print(
        f"tracing off: timing one request's tracing calls ({config.off_path_requests:,} "
        "requests' worth, best of 3)"
    )
    out.off_path_us = cpu_us_per_request(config.off_path_requests)
    console.print(f"  {out.off_path_us:.2f} µs CPU per request")
    work_dir = Path(tempfile.mkdtemp(prefix="tandem-tracing-"))
    servers: list[Server] = []
    by_run: dict[tuple[str, int, int], list[LevelResult]] = {}
    try:
        for role in ("prefill", "decode"):
            servers.append(
                start_fake_engine(f"fake-{role}", config.timing, MODEL, work_dir, engine_cores)
            )
        prefill, decode = servers
        receiver = start_receiver(work_dir, engine_cores)
        servers.append(receiver)
        gateways: dict[str, tuple[Server, str | None]] = {}
        for traced in (False, True):
            setup = TandemSetup(
                auth=config.auth,
                max_in_flight_per_worker=max(4096, 2 * max(config.levels)),
                tracing=traced,
            )
            endpoint = receiver.url if traced else None
            server, key = start_tandem(
                setup, prefill.url, decode.url, MODEL, work_dir, server_cores, endpoint
            )
            servers.append(server)
            gateways[setup.label] = server, key
            console.print(f"[bold]{setup.label}[/] (pid {server.pid}, {server.url})")

        def engine_cpu() -> tuple[float, float]:
            times = [prefill.cpu_times(), decode.cpu_times()]
            return sum(t[0] for t in times), sum(t[1] for t in times)

        idle = {}
        for name, (server, _) in gateways.items():
            idle[name] = await idle_cpu_rate(server.cpu_times, config.idle_s)
            console.print(f"  {name} idle CPU: {idle[name]:.1f} ms/s (subtracted)")
        for k in range(config.rounds):
            order = (OFF, ON) if k % 2 == 0 else (ON, OFF)
            console.print(f"[bold]round {k + 1}/{config.rounds}[/]: {order[0]} first")
            for concurrency, spec in level_runs(config):
                for name in order:
                    server, key = gateways[name]
                    target = Target(base_url=server.url, model=MODEL, api=Api.CHAT)
                    tenant = TenantSpec(name="bench", api_key=key)
                    result = await run_level(
                        name, target, tenant, concurrency, spec, server.cpu_times, engine_cpu,
                        idle[name],
                    )  # fmt: skip
                    by_run.setdefault((name, concurrency, spec.num_tokens), []).append(result)
                    one_token = spec.num_tokens != config.spec.num_tokens
                    label = f"{name} r{k + 1}" + (" (1 token)" if one_token else "")
                    labelled = dataclasses.replace(result, target=label)
                    (out.extra if one_token else out.results).append(labelled)
                    say(console, labelled)
        for name, (server, _) in gateways.items():
            out.paths[name] = gateway_paths(server.url)
        async with httpx.AsyncClient(timeout=5) as client:
            for engine in (prefill, decode):
                stats = (await client.get(engine.url + "/_fake/stats")).json()
                stats.pop("last_bodies", None)
                out.engine_stats[engine.name] = stats
        gateways[ON][0].stop()  # its exporter flushes the spans it still holds
        out.receiver_cpu_s = receiver.cpu_seconds()
        received, exports = stop_receiver(receiver)
    finally:
        for server in reversed(servers):
            server.stop()
        if config.keep_work_dir:
            console.print(f"logs and state kept in {work_dir}")
        else:
            shutil.rmtree(work_dir, ignore_errors=True)
    num_traced = sum(r.num_warmup + r.summary.sent for (n, _, _), rs in by_run.items()
                     if n == ON for r in rs)  # fmt: skip
    out.spans = SpanCount(received, exports, num_traced)
    check_spans(out.spans)
    out.costs = [
        TracingCost(level, *_pooled(by_run, level, config.spec.num_tokens), out.off_path_us)
        for level in config.levels
    ]
    if config.fit_concurrency and config.spec.num_tokens != 1:
        for name in (OFF, ON):
            short = Pooled(tuple(by_run[name, config.fit_concurrency, 1]))
            full = Pooled(tuple(by_run[name, config.fit_concurrency, config.spec.num_tokens]))
            if (fit := fit_cost(short, full)) is not None:
                out.fits[name] = fit
    return out


def level_runs(config: TracingRunConfig) -> list[tuple[int, LoadSpec]]:
    """What each gateway runs in a round: every level, then the 1-token level of the fit (and
    its full-length twin when the levels lack it)."""
    runs = [(level, config.spec) for level in config.levels]
    fit = config.fit_concurrency
    if fit and config.spec.num_tokens != 1:
        runs.append((fit, dataclasses.replace(config.spec, num_tokens=1)))
        if fit not in config.levels:
            runs.append((fit, config.spec))
    return runs


def _pooled(
    by_run: dict[tuple[str, int, int], list[LevelResult]], level: int, num_tokens: int
) -> tuple[Pooled, Pooled]:
    off, on = (Pooled(tuple(by_run[name, level, num_tokens])) for name in (OFF, ON))
    return off, on


def start_receiver(work_dir: Path, cores: frozenset[int] | None) -> Server:
    """``python -m tests.otlp_receiver`` pinned to ``cores``; its ``url`` is the traces
    endpoint, once it wrote its port."""
    port_file = work_dir / "otlp-receiver.port"
    argv = [sys.executable, "-m", "tests.otlp_receiver", str(port_file)]
    process, log_path = spawn("otlp-receiver", argv, work_dir, cores)
    server = Server("otlp-receiver", "", process, log_path, cores)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (port_file.exists() and (port := port_file.read_text().strip())):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise StartError(f"the OTLP receiver did not start:\n{server.log_tail()}")
        time.sleep(0.1)
    server.url = f"http://127.0.0.1:{port}/v1/traces"
    return server


def stop_receiver(receiver: Server) -> tuple[int, int]:
    """Stop the receiver; the spans and exports it says it received."""
    receiver.stop()
    counts = re.search(r"spans=(\d+) exports=(\d+)", receiver.log_tail())
    if counts is None:
        raise TracingRunError(f"the OTLP receiver printed no count:\n{receiver.log_tail()}")
    return int(counts[1]), int(counts[2])
