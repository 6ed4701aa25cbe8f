"""Noisy neighbours: does a light, latency-sensitive tenant keep its TTFT while two weighted
tenants flood the engine, and do the two get served in their weights' ratio?

Against a running gateway (``tandem up``) with its admin key. Three tenants are created with
fresh names: ``heavy-w1`` (weight 1), ``heavy-w3`` (weight 3), and ``light`` in
``--light-band``. Phase 1 measures the light tenant alone (``--light-rate`` short streamed chat
requests a second); phase 2 repeats that while each heavy tenant keeps ``--streams`` streams
open back to back. Issue 19's figures come from ``tandem up`` run with
``TANDEM_MAX_IN_FLIGHT_PER_WORKER=8`` and ``TANDEM_QUEUE_TIMEOUT_S=300`` (at its 1/4 share of 8
slots, the weight-1 tenant's 24 streams each queue about a minute; a shorter queue timeout turns
its backlog into 503s, which is the timeout working, not unfairness).

Served tokens are counted as they stream, inside the measured window only: a request's prompt
when its first chunk lands in the window, plus 2 x each output chunk that lands in it (the VTC
cost: output weighs twice a prompt token), with chunk sizes from the request's final usage. So
requests cut by the window's edges count for what they received inside it.

The profile says where the light tenant's TTFT goes under the flood: the gateway's own split by
band (queue wait, TTFT), the workers' (vLLM's queue time, prefill time, time per output token,
preemptions) over the same window, and each process's CPU use (the machine's cores are shared
by the gateway, the workers and this load generator). The load generator's own event-loop stalls
in the window are printed too: while it stalls it neither reads nor sends, the heavy tenants'
queues drain (the weight-3 tenant's first), and the served ratio then describes the client. So a
window with a stall of 2 s or more is discarded and another measured (``--max-windows`` in all),
and each window prints what the host did meanwhile (CPU steal, iowait, the kernel's pressure
stalls, this loop's own wait for a CPU: ``bench.host_pressure``), which says whether this process
was starved, blocked, or stopped with the whole machine.

    .venv/bin/python -m bench.noisy_neighbours --admin-key KEY --light-band interactive
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import httpx
import openai
import psutil
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from bench import host_pressure
from bench.loop_lag import LoopLag
from bench.stats import percentile

LIGHT_QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Name one colour."}]
HEAVY_QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a short story about a lighthouse keeper. " * 4}
]
W_OUT = 2  # VTC's output weight (admission.fair_queue.FairQueueConfig.w_out)


@dataclass
class StreamRecord:
    """One heavy request as the client saw it."""

    response_id: str | None = None
    chunk_at: list[float] = field(default_factory=list)
    """perf_counter() of every chunk that carried content."""
    prompt_tokens: int = 0
    completion_tokens: int | None = None
    """From the final usage chunk; None when the stream ended without one."""

    def served_in(self, start: float, end: float) -> float:
        """Prompt + W_OUT x output tokens that reached the client within [start, end)."""
        if not self.chunk_at:
            return 0.0
        per_chunk = (self.completion_tokens or len(self.chunk_at)) / len(self.chunk_at)
        inside = sum(1 for t in self.chunk_at if start <= t < end)
        prompt = self.prompt_tokens if start <= self.chunk_at[0] < end else 0
        return prompt + W_OUT * per_chunk * inside


@dataclass
class TenantLoad:
    """What one heavy tenant sent and got."""

    streams: list[StreamRecord] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def served_in(self, start: float, end: float) -> float:
        return sum(stream.served_in(start, end) for stream in self.streams)


@dataclass
class LightLoad:
    """The light tenant's requests: TTFTs of those that succeeded, errors by kind."""

    ttfts_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Window:
    """One measured window of the flood: the light tenant's requests in it, the profile over it,
    the load generator's stalls, and what the host did meanwhile (``bench.host_pressure``)."""

    start: float
    end: float
    flooded: LightLoad
    profile: dict[str, str]
    longest_stall_s: float
    """The load generator's longest event-loop stall in the window (``bench.loop_lag``)."""
    stalled_s: float
    """Its stalls of 0.1 s or more, added up."""
    host: str

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class FloodResult:
    """One run: the light tenant unloaded and flooded, the heavy tenants' service.

    ``windows`` are in the order measured; the last is the one reported. The ones before it
    were discarded because the load generator stalled in them (``flood``)."""

    unloaded: LightLoad
    heavy: dict[str, TenantLoad]
    windows: list[Window]

    @property
    def measured(self) -> Window:
        return self.windows[-1]

    @property
    def discarded(self) -> list[Window]:
        return self.windows[:-1]

    @property
    def served(self) -> dict[str, float]:
        """Tokens (prompt + 2 x output) each heavy tenant received in the measured window."""
        window = self.measured
        return {name: load.served_in(window.start, window.end) for name, load in self.heavy.items()}

    @property
    def ratio(self) -> float:
        """Weight-3 : weight-1 served tokens."""
        served = self.served
        return served["w3"] / served["w1"] if served["w1"] else float("nan")


def _kind(exc: openai.APIError) -> str:
    return str(exc.status_code) if isinstance(exc, openai.APIStatusError) else type(exc).__name__


async def _new_tenant(admin: httpx.AsyncClient, name: str, **plan: object) -> str:
    created = await admin.post("/admin/v1/tenants", json={"name": name, **plan})
    created.raise_for_status()
    issued = await admin.post(f"/admin/v1/tenants/{name}/keys", json={})
    issued.raise_for_status()
    return str(issued.json()["key"])


async def _light_request(client: openai.AsyncOpenAI, model: str, load: LightLoad) -> None:
    """One short streamed chat: its time to the first content token."""
    started = time.perf_counter()
    first: float | None = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=LIGHT_QUESTION, max_tokens=8, temperature=0, stream=True
        )
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - started
    except openai.APIError as exc:
        load.errors[_kind(exc)] = load.errors.get(_kind(exc), 0) + 1
        return
    if first is not None:
        load.ttfts_s.append(first)


async def light_phase(
    client: openai.AsyncOpenAI, model: str, rate: float, duration_s: float
) -> LightLoad:
    """``rate`` requests a second (open loop) for ``duration_s``."""
    load = LightLoad()
    tasks: list[asyncio.Task[None]] = []
    deadline = time.perf_counter() + duration_s
    while time.perf_counter() < deadline:
        tasks.append(asyncio.create_task(_light_request(client, model, load)))
        await asyncio.sleep(1.0 / rate)
    await asyncio.gather(*tasks)
    return load


async def _heavy_stream(
    client: openai.AsyncOpenAI,
    model: str,
    output_tokens: int,
    stop: asyncio.Event,
    load: TenantLoad,
) -> None:
    """One closed-loop stream: requests back to back until ``stop`` is set."""
    while not stop.is_set():
        record = StreamRecord()
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=HEAVY_QUESTION,
                max_tokens=output_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            load.streams.append(record)
            async for chunk in stream:
                record.response_id = chunk.id
                if chunk.choices and chunk.choices[0].delta.content:
                    record.chunk_at.append(time.perf_counter())
                if chunk.usage is not None:
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.completion_tokens = chunk.usage.completion_tokens
        except openai.APIError as exc:
            load.error(_kind(exc))
            await asyncio.sleep(0.5)


async def flood(
    base_url: str,
    admin_key: str,
    model: str,
    *,
    light_band: str = "interactive",
    light_rate: float = 1.0,
    streams: int = 24,
    output_tokens: int = 48,
    duration_s: float = 60.0,
    warmup_s: float = 20.0,
    max_stall_s: float = 2.0,
    max_windows: int = 3,
    settle_s: float = 10.0,
) -> FloodResult:
    """Create the three tenants, run both phases, and measure (module docstring).

    A flooded window in which the load generator stalled for ``max_stall_s`` or more is kept
    but not reported, and another is measured ``settle_s`` later, up to ``max_windows`` in all:
    the stall is the client's (or the host's), and says nothing of the gateway."""
    base = base_url.rstrip("/")
    suffix = uuid.uuid4().hex[:6]
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {admin_key}"}, timeout=10
    ) as admin:
        names = {"w1": f"heavy-w1-{suffix}", "w3": f"heavy-w3-{suffix}"}
        # A concurrency limit nobody reaches: the quota store then counts each tenant's
        # requests held (in flight + queued), which the occupancy samples read.
        keys = {
            "w1": await _new_tenant(admin, names["w1"], weight=1, max_concurrent=10_000),
            "w3": await _new_tenant(admin, names["w3"], weight=3, max_concurrent=10_000),
            "light": await _new_tenant(admin, f"light-{suffix}", band=light_band),
        }
        workers = [w["url"] for w in (await admin.get("/ready")).json()["workers"]]
        # The heavy streams may queue for minutes by design; the SDK must not give up first.
        clients = {
            name: openai.AsyncOpenAI(
                base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=duration_s + 600
            )
            for name, key in keys.items()
        }
        unloaded = await light_phase(clients["light"], model, light_rate, duration_s)
        heavy = {"w1": TenantLoad(), "w3": TenantLoad()}
        # The flood lasts until the window has closed, however long the light phase overruns
        # it: a flood that stopped at a fixed time would let the weight-3 tenant's shorter
        # queue run dry first inside the window, and the weight-1 tenant then take every slot.
        stop = asyncio.Event()
        # Interleaved, so that neither tenant takes every free slot before the other arrives (VTC
        # would then serve the other alone until their counters meet: correct, but not the steady
        # state this measures).
        tasks = [
            asyncio.create_task(
                _heavy_stream(clients[name], model, output_tokens, stop, heavy[name])
            )
            for _ in range(streams)
            for name in ("w1", "w3")
        ]
        windows: list[Window] = []
        try:
            await asyncio.sleep(warmup_s)  # the flood reaches its steady state first
            while True:
                windows.append(
                    await _window(admin, names, base, workers, clients["light"], model,
                                  light_rate, duration_s)
                )  # fmt: skip
                if windows[-1].longest_stall_s < max_stall_s or len(windows) == max_windows:
                    break
                # The streams refill the queues as soon as the generator runs again.
                await asyncio.sleep(settle_s)
        finally:
            stop.set()
        await asyncio.gather(*tasks)  # nothing is cut: every request sent is seen to its end
        for client in clients.values():
            await client.close()
        return FloodResult(unloaded, heavy, windows)


async def _window(
    admin: httpx.AsyncClient,
    names: dict[str, str],
    base: str,
    workers: list[str],
    light: openai.AsyncOpenAI,
    model: str,
    light_rate: float,
    duration_s: float,
) -> Window:
    """One light phase under the flood, with the profile, the generator's stalls and the host's
    pressure over it."""
    # A stalled generator stops reading and sending: the weight-3 tenant's shorter queue runs
    # dry meanwhile, and the window then measures the client, not the gateway.
    lag = LoopLag()
    async with Profiler(base, workers) as profiler:
        host_before = host_pressure.sample()
        lag.start()
        start = time.perf_counter()
        occupancy = asyncio.create_task(_sample_occupancy(admin, names))
        try:
            flooded = await light_phase(light, model, light_rate, duration_s)
        finally:
            end = time.perf_counter()
            await lag.aclose()
            occupancy.cancel()
        samples = await occupancy
        host = host_pressure.describe(host_before, host_pressure.sample(), end - start)
    profile = dict(profiler.report)
    for name, (in_flight, queued) in samples.items():
        profile[f"heavy {name} in flight / queued (mean of 1 s samples)"] = (
            f"{statistics.fmean(in_flight or [0]):.1f} / {statistics.fmean(queued or [0]):.1f}"
        )
    return Window(start, end, flooded, profile, lag.longest_s, lag.late_s(), host)


def run_flood(base_url: str, admin_key: str, model: str, **options: Any) -> FloodResult:
    """``flood`` on an event loop of its own: what a process pool runs, so that the load
    generator does not share a process (its heap, its other threads) with its caller."""
    return asyncio.run(flood(base_url, admin_key, model, **options))


async def _sample_occupancy(
    admin: httpx.AsyncClient, names: dict[str, str]
) -> dict[str, tuple[list[int], list[int]]]:
    """Each heavy tenant's requests in flight and queued, once a second, until cancelled: both
    must stay backlogged for the weighted share to mean anything."""
    samples: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name in names}
    try:
        while True:
            for name, tenant in names.items():
                usage = (await admin.get(f"/admin/v1/tenants/{tenant}/usage")).json()
                queued = int(usage["queued_here"])
                samples[name][0].append(int(usage["concurrent"]) - queued)
                samples[name][1].append(queued)
            await asyncio.sleep(1.0)
    except asyncio.CancelledError:
        return samples


# -- the profile --------------------------------------------------------------------------------

_GATEWAY_HISTOGRAMS = {
    "tandem_queue_wait_seconds": "gateway queue wait",
    "tandem_time_to_first_token_seconds": "gateway TTFT",
    "tandem_stream_longest_pause_seconds": "longest pause in a stream",
}
_WORKER_HISTOGRAMS = {
    "vllm:request_queue_time_seconds": "vLLM queue time",
    "vllm:request_prefill_time_seconds": "vLLM prefill time",
    "vllm:time_to_first_token_seconds": "vLLM TTFT",
    "vllm:request_time_per_output_token_seconds": "vLLM time per output token",
}
_WORKER_COUNTERS = {"vllm:num_preemptions_total": "vLLM preemptions"}

Samples: TypeAlias = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Histogram ``_sum``/``_count`` and counter ``_total`` samples by (name, labels but ``le``)."""


def _samples(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            if sample.name.endswith(("_sum", "_count", "_total")):
                key = (sample.name, labels)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def _total(samples: Samples, name: str) -> float:
    """A counter summed over its label sets (one per engine)."""
    return sum(value for (sample, _), value in samples.items() if sample == name)


def _means(
    before: Samples,
    after: Samples,
    names: dict[str, str],
    keep: Iterable[str],
) -> dict[str, str]:
    """Mean of each histogram over the window (delta sum / delta count), per label set."""
    report: dict[str, str] = {}
    for (name, labels), count in after.items():
        base = name.removesuffix("_count")
        if not name.endswith("_count") or base not in names:
            continue
        delta_count = count - before.get((name, labels), 0.0)
        if delta_count <= 0:
            continue
        delta_sum = after[(f"{base}_sum", labels)] - before.get((f"{base}_sum", labels), 0.0)
        shown = ",".join(f"{k}={v}" for k, v in labels if k in keep)
        report[f"{names[base]} {{{shown}}}"] = (
            f"mean {1000 * delta_sum / delta_count:.0f} ms over {delta_count:.0f}"
        )
    return report


class Profiler:
    """Metrics and CPU use over a window: ``async with Profiler(...) as p: ...; p.report``."""

    def __init__(self, gateway: str, workers: list[str]) -> None:
        self._gateway = gateway
        self._workers = workers
        self._http = httpx.AsyncClient(timeout=10)
        self._before: dict[str, Samples] = {}
        self._cpu_before: dict[int, tuple[str, float]] = {}
        self._started = 0.0
        self.report: dict[str, str] = {}

    async def _scrape(self) -> dict[str, Samples]:
        urls = [self._gateway, *self._workers]
        texts = await asyncio.gather(*(self._http.get(f"{url}/metrics") for url in urls))
        return {url: _samples(text.text) for url, text in zip(urls, texts, strict=True)}

    async def __aenter__(self) -> Profiler:
        self._before = await self._scrape()
        self._cpu_before = _cpu_times()
        self._started = time.perf_counter()
        return self

    async def __aexit__(self, *exc: object) -> None:
        elapsed = time.perf_counter() - self._started
        cpu_after = _cpu_times()
        after = await self._scrape()
        await self._http.aclose()
        report = _means(
            self._before[self._gateway], after[self._gateway], _GATEWAY_HISTOGRAMS, ("band",)
        )
        for url in self._workers:
            port = url.rsplit(":", 1)[-1]
            for label, value in _means(
                self._before[url], after[url], _WORKER_HISTOGRAMS, ()
            ).items():
                report[f"{label.removesuffix(' {}')} (worker :{port})"] = value
            for name, label in _WORKER_COUNTERS.items():
                delta = _total(after[url], name) - _total(self._before[url], name)
                report[f"{label} (worker :{port})"] = f"{delta:.0f}"
        busy: dict[str, float] = {}
        for pid, (name, seconds) in cpu_after.items():
            spent = seconds - self._cpu_before.get(pid, (name, seconds))[1]
            busy[name] = busy.get(name, 0.0) + spent
        cores = psutil.cpu_count() or 1
        for name, seconds in sorted(busy.items(), key=lambda item: -item[1]):
            if seconds / elapsed >= 0.01:
                report[f"CPU {name}"] = f"{seconds / elapsed:.2f} cores of {cores}"
        self.report = report


def _cpu_times() -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by each process of the stack and by this load generator."""
    out: dict[int, tuple[str, float]] = {}
    me = psutil.Process()
    for proc in psutil.process_iter(["pid", "cmdline", "name"]):
        try:
            name = _role(proc, me)
            if name is not None:
                times = proc.cpu_times()
                out[proc.pid] = (name, times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _role(proc: psutil.Process, me: psutil.Process) -> str | None:
    """Which part of the stack a process is, by its command line or its parent's."""
    if proc.pid == me.pid:
        return "load generator (this bench)"
    cmdline = " ".join(proc.info.get("cmdline") or [])
    if "tandem up" in cmdline:
        return "gateway (tandem up)"
    for candidate in (proc, *proc.parents()):
        text = " ".join(candidate.cmdline())
        if "vllm" in text and "--port" in text:
            port = text.split("--port", 1)[1].split()[0]
            return f"vLLM worker :{port} ({'API server' if candidate is proc else 'engine'})"
    return None


# -- the command --------------------------------------------------------------------------------


def print_result(result: FloodResult, light_band: str) -> None:
    """The issue-19 table row, the heavy tenants' errors, and the profile."""
    un, fl = result.unloaded.ttfts_s, result.measured.flooded.ttfts_s
    print(
        "| light band | w3:w1 served tokens | light TTFT unloaded p50 / p95 "
        "| under the flood p50 / p95 | p95 flooded / unloaded | light ok (unloaded, flood) |"
    )
    print("|---|---|---|---|---|---|")
    print(
        f"| {light_band} | {result.ratio:.2f} "
        f"| {1000 * statistics.median(un):.0f} / {1000 * percentile(un, 95):.0f} ms "
        f"| {1000 * statistics.median(fl):.0f} / {1000 * percentile(fl, 95):.0f} ms "
        f"| {percentile(fl, 95) / percentile(un, 95):.2f} "
        f"| {len(un)}, {len(fl)} |"
    )
    print()
    for name, load in result.heavy.items():
        print(
            f"heavy {name}: {len(load.streams)} requests, "
            f"{result.served[name]:.0f} tokens served in the {result.measured.seconds:.0f} s "
            f"window, errors {load.errors or 'none'}"
        )
    print(f"light errors unloaded: {result.unloaded.errors or 'none'}")
    for number, window in enumerate(result.windows, start=1):
        verdict = "measured" if window is result.measured else "discarded"
        print(
            f"window {number} ({verdict}, {window.seconds:.0f} s): the load generator's longest "
            f"event-loop stall {1000 * window.longest_stall_s:.0f} ms, {window.stalled_s:.1f} s "
            f"in stalls of 0.1 s+; light ok {len(window.flooded.ttfts_s)}, errors "
            f"{window.flooded.errors or 'none'}; host: {window.host}"
        )
    print("\nprofile over the measured window:")
    for label, value in result.measured.profile.items():
        print(f"  {label}: {value}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--admin-key", required=True)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--light-band", choices=["interactive", "standard", "batch"], default="interactive"
    )
    p.add_argument("--light-rate", type=float, default=1.0, help="light requests a second")
    p.add_argument("--streams", type=int, default=24, help="open streams per heavy tenant")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--duration-s", type=float, default=60.0, help="each measured phase")
    p.add_argument("--warmup-s", type=float, default=20.0, help="flood before measuring")
    p.add_argument(
        "--max-windows", type=int, default=3,
        help="flooded windows to try when the load generator stalls 2 s or more in one",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args(argv)
    result = run_flood(
        args.base_url, args.admin_key, args.model,
        light_band=args.light_band, light_rate=args.light_rate, streams=args.streams,
        output_tokens=args.output_tokens, duration_s=args.duration_s, warmup_s=args.warmup_s,
        max_windows=args.max_windows,
    )  # fmt: skip
    print_result(result, args.light_band)
    if args.json:
        un, fl = result.unloaded.ttfts_s, result.measured.flooded.ttfts_s
        figures = {
            "light_band": args.light_band,
            "ratio": result.ratio,
            "unloaded_p50_ms": 1000 * statistics.median(un),
            "unloaded_p95_ms": 1000 * percentile(un, 95),
            "flooded_p50_ms": 1000 * statistics.median(fl),
            "flooded_p95_ms": 1000 * percentile(fl, 95),
            "heavy_errors": {name: load.errors for name, load in result.heavy.items()},
            "generator_longest_stall_ms": 1000 * result.measured.longest_stall_s,
            "windows_discarded": len(result.discarded),
        }
        json.dump(figures, sys.stdout)
        print()


if __name__ == "__main__":
    main()
