"""What the gateway's streaming path costs: inter-token latency added by the output moderation
window and by SSE heartbeats, and the memory each open stream holds.

    python -m bench.streaming            # full sizes: ~2.5 minutes on 2 cores
    python -m bench.streaming --quick    # small sizes: under a minute

Self-contained (no vLLM, no GPU): a fake vLLM engine (``python -m tests.fakes.fake_engine``)
and one gateway per configuration (``python -m bench.streaming --serve ...``, on uvloop and
httptools as ``tandem up`` runs it) run as child processes; this process is the client, reading
raw SSE with aiohttp. By default the gateway has a CPU of its own and the client and engine
share the rest; the gateway's CPU time per stream is reported next to the latencies. There is
no prefill pool, so every request runs on the fake decode engine and the figures are the
gateway's own streaming path: relay, output moderation, SSE framing, heartbeats.

1. Output moderation: the same load (``--streams`` chat streams per configuration,
   ``--concurrency`` at a time, ``--output-tokens`` each, engine token delay
   ``--token-delay-ms``) through a gateway with output moderation off and one with it on
   (default policy: output providers ``["rules"]``, actions ``{"pii": "redact", "*": "block"}``,
   the default window); TTFT and ITL p50/p99 and the differences.
2. Heartbeats: the same load with ``sse_ping_interval_s`` 0 (no heartbeat timer),
   0.05 s (pings interleave with tokens) and 15 s (the default).
3. Memory: gateway RSS (``VmRSS`` of ``/proc/<pid>/status``) before and with ``--idle-streams``
   streams open against an engine that sends one token and then goes quiet for an hour.

TTFT = request sent -> first chunk with content; ITL = gap between consecutive content chunks
as the client receives them, pooled over all requests. In 1 and 2 the configurations take
turns in ``--rounds`` rounds with a rotating order, so drift hits all of them alike. Prompts
are fixed and the fake's output is seeded by the prompt, so runs are comparable.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import uvicorn

from core.messages import WorkerRole
from core.models import ServedModel
from core.moderation import ModerationPolicy
from gateway.assembly.app import AccessConfig, GatewayConfig, create_app
from gateway.assembly.stores import StoreConfig
from gateway.serving.content_policy import ModerationSetup
from gateway.serving.upstream import UpstreamConfig
from moderation.stream import StreamConfig
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What are three good habits for a software engineer?",
    "Describe how a bicycle works.",
)

MODEL = "fake-model"
MAX_MODEL_LEN = 8192
OUTPUT_POLICY = ModerationPolicy.from_dict(
    {"output": {"providers": ["rules"], "actions": {"pii": "redact", "*": "block"}}}
)
IDLE_TOKEN_DELAY_S = 3600.0
"""The idle engine's pause after the first token: longer than any measurement."""
READY_TIMEOUT_S = 60.0
OPEN_BURST = 100
"""Idle streams being opened at once (the rest wait their turn, then stay open)."""
FULL = {"streams": 512, "concurrency": 32, "output_tokens": 128, "idle_streams": 1000, "rounds": 4}
QUICK = {"streams": 64, "concurrency": 16, "output_tokens": 64, "idle_streams": 200, "rounds": 2}


@dataclass(frozen=True, slots=True)
class Variant:
    """One gateway configuration under test."""

    label: str
    moderation: bool = False
    ping_interval_s: float = 15.0

    def serve_args(self, engine_url: str, max_in_flight: int) -> list[str]:
        return [
            "--serve", "--engine-url", engine_url, "--ping-interval-s", repr(self.ping_interval_s),
            "--max-in-flight", str(max_in_flight), *(["--moderation"] if self.moderation else []),
        ]  # fmt: skip


BASE = Variant("moderation off")
MODERATED = Variant("moderation on", moderation=True)
PING_OFF = Variant("ping 0 (off)", ping_interval_s=0.0)
PING_FAST = Variant("ping 0.05 s", ping_interval_s=0.05)
PING_DEFAULT = Variant("ping 15 s (default)")  # the same configuration as BASE


# --- the gateway side (``--serve``, in a child process) -----------------------------------


async def serve(args: argparse.Namespace) -> None:
    """Run one gateway over the fake engine at ``--engine-url`` until SIGTERM/SIGINT."""
    prefill = WorkerPool(PoolConfig(WorkerRole.PREFILL))
    decode = WorkerPool(PoolConfig(WorkerRole.DECODE, external_urls=(args.engine_url,)))
    state_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    try:
        await prefill.start()
        await decode.start()
        await decode.wait_ready(timeout_s=READY_TIMEOUT_S)
        config = GatewayConfig(
            # Idle streams in part 3 stay silent far longer than the default 120 s.
            upstream=UpstreamConfig(decode_idle_timeout_s=2 * IDLE_TOKEN_DELAY_S),
            sse_ping_interval_s=args.ping_interval_s,
            access=AccessConfig(
                auth_required=False,
                stores=StoreConfig(sqlite_path=state_dir / "tandem.db"),
                max_in_flight_per_worker=args.max_in_flight,
                max_queue=args.max_in_flight,
            ),
            moderation=ModerationSetup(
                default_policy=OUTPUT_POLICY if args.moderation else ModerationPolicy()
            ),
        )
        deployment = Deployment(ServedModel(MODEL, MAX_MODEL_LEN, 0), prefill, decode)
        app = create_app(config, Deployments([deployment]))
        # IPPROTO_TCP spelled out: the stdlib loop sets TCP_NODELAY only on sockets whose proto
        # says TCP (uvloop always does); with Nagle on, the events of a stream on a reused
        # connection would wait ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                http="httptools",
                lifespan="on",
                backlog=4096,
                timeout_graceful_shutdown=2,
            )
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if serving.done():
                serving.result()  # startup failed: raise its error
                raise RuntimeError("the gateway stopped before it started")
            await asyncio.sleep(0.02)
        print(f"GATEWAY_READY http://127.0.0.1:{port}", flush=True)
        await serving
    finally:
        await decode.aclose()
        await prefill.aclose()
        shutil.rmtree(state_dir, ignore_errors=True)


# --- child processes -----------------------------------------------------------------------


@dataclass
class Child:
    """A child process that announced its URL on stdout; stderr goes to ``log_path``."""

    name: str
    process: asyncio.subprocess.Process
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    async def stop(self) -> None:
        if self.process.returncode is None:
            self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 15)
            except TimeoutError:
                self.process.kill()
                await self.process.wait()


async def spawn(
    name: str, argv: Sequence[str], ready: bytes, log_dir: Path, cpus: set[int] | None
) -> Child:
    """Start ``argv``, pin it to ``cpus`` and wait for its ``<ready> <url>`` line."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=log_file
        )
    if cpus:
        os.sched_setaffinity(process.pid, cpus)
    assert process.stdout is not None  # stdout=PIPE
    try:
        while True:
            line = await asyncio.wait_for(process.stdout.readline(), READY_TIMEOUT_S)
            if not line:
                raise RuntimeError(f"{name} exited before it was ready")
            if line.startswith(ready):
                return Child(name, process, line.split()[1].decode(), log_path)
    except (RuntimeError, TimeoutError) as exc:
        if process.returncode is None:
            process.kill()
        await process.wait()
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name} did not start ({exc!r}); its log ends:\n{tail}") from exc


async def spawn_engine(
    output_tokens: int, token_delay_s: float, log_dir: Path, cpus: set[int] | None
) -> Child:
    argv = [
        sys.executable, "-m", "tests.fakes.fake_engine", "--role", "decode",
        "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--output-tokens", str(output_tokens), "--token-delay-s", repr(token_delay_s),
    ]  # fmt: skip
    return await spawn("fake-engine", argv, b"FAKE_ENGINE_READY", log_dir, cpus)


async def spawn_gateway(
    variant: Variant, engine_url: str, max_in_flight: int, log_dir: Path, cpus: set[int] | None
) -> Child:
    argv = [sys.executable, "-m", "bench.streaming", *variant.serve_args(engine_url, max_in_flight)]
    name = "gateway-" + "".join(c if c.isalnum() else "-" for c in variant.label)
    return await spawn(name, argv, b"GATEWAY_READY", log_dir, cpus)


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB, from ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU time ``pid`` has used, from ``/proc/<pid>/stat``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_open_file_limit() -> int:
    """Soft ``RLIMIT_NOFILE`` up to the hard limit (children inherit it); returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --- the client side -----------------------------------------------------------------------


@dataclass
class Samples:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    num_ok: int = 0
    num_errors: int = 0
    num_pings: int = 0
    num_content_chunks: int = 0
    num_chars: int = 0
    num_redacted: int = 0
    gateway_cpu_s: float = 0.0
    finish_reasons: Counter[str] = field(default_factory=Counter)


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def content_of(line: bytes) -> tuple[str | None, str | None, bool]:
    """(content, finish_reason, is_error) of one SSE line; content None when it has none."""
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return None, None, False
    chunk = orjson.loads(line[6:])
    if "error" in chunk:
        return None, None, True
    choices = chunk.get("choices") or []
    if not choices:
        return None, None, False
    return (
        choices[0].get("delta", {}).get("content") or None,
        choices[0].get("finish_reason"),
        False,
    )


async def one_stream(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, into: Samples
) -> None:
    sent = time.perf_counter()
    last: float | None = None
    finish: str | None = None
    async with session.post(f"{url}/v1/chat/completions", json=chat_body(prompt, max_tokens)) as r:
        if r.status != 200:
            await r.read()
            into.num_errors += 1
            return
        async for raw in r.content:
            if raw.startswith(b":"):
                into.num_pings += 1
                continue
            content, finish_reason, failed = content_of(raw.strip())
            if failed:
                into.num_errors += 1
                return
            finish = finish_reason or finish
            if content is None:
                continue
            now = time.perf_counter()
            if last is None:
                into.ttft_s.append(now - sent)
            else:
                into.itl_s.append(now - last)
            last = now
            into.num_content_chunks += 1
            into.num_chars += len(content)
            into.num_redacted += content.count("[REDACTED")
    into.finish_reasons[finish or "none"] += 1
    if finish in ("length", "stop"):
        into.num_ok += 1
    else:
        into.num_errors += 1


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    num_streams: int,
    concurrency: int,
    max_tokens: int,
    into: Samples,
    stagger_s: float = 0.0,
) -> None:
    """``num_streams`` streams, ``concurrency`` open at any time. The first ones start
    ``stagger_s`` apart: streams of equal length started together would end and restart in
    bursts, and TTFT would measure the burst's queue rather than the gateway's path."""
    slots = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> None:
        async with slots:
            if i < concurrency:
                await asyncio.sleep(i * stagger_s)
            await one_stream(session, url, PROMPTS[i % len(PROMPTS)], max_tokens, into)

    await asyncio.gather(*(bounded(i) for i in range(num_streams)))


def new_session(timeout_s: float | None) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        json_serialize=lambda obj: orjson.dumps(obj).decode(),
    )


async def compare(
    variants: Sequence[Variant],
    engine: Child,
    args: argparse.Namespace,
    log_dir: Path,
    gateway_cpus: set[int] | None,
) -> dict[str, Samples]:
    """Each variant on its own gateway, taking turns in rounds; samples by label."""
    max_in_flight = 4 * args.concurrency
    gateways = await asyncio.gather(
        *(spawn_gateway(v, engine.url, max_in_flight, log_dir, gateway_cpus) for v in variants)
    )
    results = {v.label: Samples() for v in variants}
    try:
        async with new_session(600) as session:
            for gateway in gateways:  # warm-up: imports, first connections, rule compilation
                await run_load(
                    session, gateway.url, args.concurrency, args.concurrency,
                    args.output_tokens, Samples(),
                )  # fmt: skip
            per_round = math.ceil(args.streams / args.rounds)
            stagger_s = args.output_tokens * args.token_delay_ms / 1000 / args.concurrency
            for r in range(args.rounds):
                for k in range(len(variants)):
                    i = (r + k) % len(variants)
                    into, cpu_before = results[variants[i].label], cpu_s(gateways[i].pid)
                    await run_load(
                        session, gateways[i].url, per_round, args.concurrency,
                        args.output_tokens, into, stagger_s,
                    )  # fmt: skip
                    into.gateway_cpu_s += cpu_s(gateways[i].pid) - cpu_before
    finally:
        await asyncio.gather(*(g.stop() for g in gateways))
    return results


class IdleStreams:
    """Streams held open and idle after their first token; owns their tasks."""

    def __init__(self, session: aiohttp.ClientSession, url: str, max_tokens: int) -> None:
        self._session = session
        self._url = url
        self._max_tokens = max_tokens
        self._tasks: set[asyncio.Task[None]] = set()
        self._opening = asyncio.Semaphore(OPEN_BURST)
        self.num_open = 0

    async def open(self, count: int, timeout_s: float) -> None:
        """Open ``count`` more streams; return once every one has its first token."""
        loop = asyncio.get_running_loop()
        ready = [loop.create_future() for _ in range(count)]
        for i, future in enumerate(ready):
            task = asyncio.create_task(self._hold(PROMPTS[i % len(PROMPTS)], future))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.wait_for(asyncio.gather(*ready), timeout_s)
        self.num_open += count

    async def _hold(self, prompt: str, ready: asyncio.Future[None]) -> None:
        body = chat_body(prompt, self._max_tokens)
        response: aiohttp.ClientResponse | None = None
        try:
            async with self._opening:
                response = await self._session.post(f"{self._url}/v1/chat/completions", json=body)
                if response.status != 200:
                    raise RuntimeError(f"{response.status}: {await response.text()}")
                async for raw in response.content:
                    if content_of(raw.strip())[0] is not None:
                        break
                else:
                    raise RuntimeError("the stream ended before its first token")
            ready.set_result(None)
            async for _ in response.content:
                pass  # heartbeats only, until aclose() cancels this
        except (aiohttp.ClientError, RuntimeError, OSError) as exc:
            if not ready.done():
                ready.set_exception(exc)
        finally:
            if response is not None:
                response.close()

    async def aclose(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def settled_rss_kib(*pids: int) -> list[int]:
    """Each process's RSS once it has settled: the median of three reads 0.5 s apart."""
    await asyncio.sleep(1.0)
    reads = []
    for _ in range(3):
        reads.append([rss_kib(pid) for pid in pids])
        await asyncio.sleep(0.5)
    return [sorted(column)[1] for column in zip(*reads, strict=True)]


async def idle_memory(
    args: argparse.Namespace, log_dir: Path, gateway_cpus: set[int] | None, cpus: set[int] | None
) -> tuple[list[int], list[list[int]], int]:
    """Stream counts, [gateway, engine] RSS KiB at each, and the gateway's pid."""
    total = args.idle_streams
    engine = await spawn_engine(2, IDLE_TOKEN_DELAY_S, log_dir, cpus)
    try:
        gateway = await spawn_gateway(BASE, engine.url, 2 * total, log_dir, gateway_cpus)
        try:
            async with new_session(None) as session:
                warm = IdleStreams(session, gateway.url, 2)  # first-use allocations
                await warm.open(min(16, total), 60)
                await warm.aclose()
                counts, rss = [0], [await settled_rss_kib(gateway.pid, engine.pid)]
                streams = IdleStreams(session, gateway.url, 2)
                try:
                    for target in (total // 2, total):
                        await streams.open(target - streams.num_open, 300)
                        counts.append(streams.num_open)
                        rss.append(await settled_rss_kib(gateway.pid, engine.pid))
                finally:
                    await streams.aclose()
        finally:
            await gateway.stop()
    finally:
        await engine.stop()
    return counts, rss, gateway.pid


# --- tables --------------------------------------------------------------------------------


def ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def cpu_ms_per_stream(samples: Samples) -> float:
    return samples.gateway_cpu_s * 1000 / max(1, samples.num_ok + samples.num_errors)


def latency_table(results: dict[str, Samples], baseline: str, versus: str) -> list[str]:
    """One row per configuration, then each one's difference from ``baseline`` (``versus``
    names it in the row label)."""
    lines = [
        f"{'config':<28} {'ok':>5} {'err':>4} {'pings/stream':>12} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'gw CPU/stream':>13}  (ms)"
    ]
    for label, s in results.items():
        streams = max(1, s.num_ok + s.num_errors)
        lines.append(
            f"{label:<28} {s.num_ok:>5} {s.num_errors:>4} {s.num_pings / streams:>12.1f} "
            f"{ms(s.ttft_s, 50):>9.1f} {ms(s.ttft_s, 99):>9.1f} {ms(s.itl_s, 50):>8.2f} "
            f"{ms(s.itl_s, 99):>8.2f} {cpu_ms_per_stream(s):>13.2f}"
        )
    base = results[baseline]
    for label, s in results.items():
        if label == baseline:
            continue
        name = f"{label} - {versus}"
        lines.append(
            f"{name:<28} {'':>5} {'':>4} {'':>12} "
            f"{ms(s.ttft_s, 50) - ms(base.ttft_s, 50):>+9.1f} "
            f"{ms(s.ttft_s, 99) - ms(base.ttft_s, 99):>+9.1f} "
            f"{ms(s.itl_s, 50) - ms(base.itl_s, 50):>+8.2f} "
            f"{ms(s.itl_s, 99) - ms(base.itl_s, 99):>+8.2f} "
            f"{cpu_ms_per_stream(s) - cpu_ms_per_stream(base):>+13.2f}"
        )
    errors = {label: dict(s.finish_reasons) for label, s in results.items() if s.num_errors}
    if errors:
        lines.append(f"streams with errors, finish reasons by config: {errors}")
    return lines


def moderation_note(results: dict[str, Samples], token_delay_ms: float) -> list[str]:
    window = StreamConfig().window_chars
    off, on = results[BASE.label], results[MODERATED.label]
    chars_per_token = off.num_chars / max(1, off.num_content_chunks)
    held_tokens = window / chars_per_token
    measured = ms(on.ttft_s, 50) - ms(off.ttft_s, 50)
    return [
        f"note: the output window holds back the last window_chars={window} characters of each "
        f"choice, so the first text",
        f"  leaves only once more than {window} have arrived: ~{held_tokens:.1f} tokens of "
        f"~{chars_per_token:.1f} chars here, ~{held_tokens * token_delay_ms:.0f} ms at "
        f"{token_delay_ms:g} ms/token (measured: TTFT p50 {measured:+.0f} ms).",
        "  That delay shows in TTFT; the held-back tail leaves with the finish, so ITL "
        f"carries only the per-chunk check. Content chunks seen: off {off.num_content_chunks}, "
        f"on {on.num_content_chunks}; redactions {on.num_redacted}.",
    ]


def memory_table(counts: list[int], rss: list[list[int]]) -> list[str]:
    lines = [
        f"{'open idle streams':>17} {'gateway RSS MiB':>15} {'delta MiB':>9} {'KiB/stream':>10}"
        f" {'fake engine KiB/stream':>22}"
    ]
    (gateway_0, engine_0) = rss[0]
    for count, (gateway, engine) in zip(counts, rss, strict=True):
        per_stream = f"{(gateway - gateway_0) / count:>10.1f}" if count else ""
        engine_per_stream = f"{(engine - engine_0) / count:>22.1f}" if count else ""
        lines.append(
            f"{count:>17} {gateway / 1024:>15.1f} {(gateway - gateway_0) / 1024:>9.1f} "
            f"{per_stream:>10} {engine_per_stream:>22}"
        )
    if len(counts) >= 3 and counts[-1] > counts[-2]:
        marginal = (rss[-1][0] - rss[-2][0]) / (counts[-1] - counts[-2])
        lines.append(
            f"gateway, marginal {counts[-2]} -> {counts[-1]} streams: {marginal:.1f} KiB/stream "
            "(free of warm-up and fixed costs)"
        )
    lines.append(
        "the fake engine (aiohttp server: one connection and one handler task per stream) "
        "is there for scale"
    )
    return lines


# --- main ----------------------------------------------------------------------------------


def placement(cpu_count: int, pin: bool) -> tuple[set[int] | None, set[int] | None, str]:
    """CPUs for the gateway and for the client + engine, and a line saying so."""
    if not pin or cpu_count < 2 or not hasattr(os, "sched_setaffinity"):
        return None, None, f"unpinned, {cpu_count} CPU(s) shared by the OS scheduler"
    gateway = {cpu_count - 1}
    others = set(range(cpu_count - 1))
    return gateway, others, f"gateway pinned to CPU {cpu_count - 1}, client and engine to {others}"


async def run(args: argparse.Namespace) -> None:
    nofile = raise_open_file_limit()
    cpu_count = os.cpu_count() or 1
    gateway_cpus, other_cpus, where = placement(cpu_count, args.pin)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-streaming-"))
    token_delay_s = args.token_delay_ms / 1000
    started = time.perf_counter()
    print(
        f"processes: client = this process (pid {os.getpid()}, aiohttp, raw SSE); fake engine = "
        "`python -m tests.fakes.fake_engine` (own process);"
    )
    print(
        "  each gateway = `python -m bench.streaming --serve` (own process, uvicorn, "
        "anonymous tenant, no prefill pool)"
    )
    print(f"CPUs: {cpu_count}; {where}; open-file limit {nofile}")
    print(
        f"load: {args.streams} streams per config, {args.concurrency} concurrent, "
        f"{args.output_tokens} output tokens, engine token delay {args.token_delay_ms:g} ms, "
        f"{args.rounds} alternating rounds; gw CPU/stream = the gateway process's user + system "
        "CPU time in the measured rounds / streams"
    )
    try:
        engine = await spawn_engine(args.output_tokens, token_delay_s, log_dir, other_cpus)
        try:
            print(f"\n1. ITL added by the output moderation window (fake engine pid {engine.pid})")
            results = await compare((BASE, MODERATED), engine, args, log_dir, gateway_cpus)
            print("\n".join(latency_table(results, BASE.label, "off")))
            print("\n".join(moderation_note(results, args.token_delay_ms)))

            print("\n2. ITL added by the heartbeat machinery (moderation off)")
            variants = (PING_OFF, PING_FAST, PING_DEFAULT)
            results = await compare(variants, engine, args, log_dir, gateway_cpus)
            print("\n".join(latency_table(results, PING_OFF.label, "ping 0")))
            print(
                "note: 0 starts no ping task; 0.05 s sends `: ping` comments between tokens "
                "(pings/stream); 15 s never fires within a stream this short, and runs the "
                "same configuration as 'moderation off' in 1, so the two show run-to-run noise."
            )
        finally:
            await engine.stop()

        print(
            f"\n3. Memory per open stream: {args.idle_streams} idle streams (engine: first "
            f"token at once, then {IDLE_TOKEN_DELAY_S:.0f} s silence; moderation off, pings 15 s)"
        )
        counts, rss, pid = await idle_memory(args, log_dir, gateway_cpus, other_cpus)
        print(f"gateway pid {pid}, VmRSS from /proc/{pid}/status")
        print("\n".join(memory_table(counts, rss)))
        print(f"\nwall time {time.perf_counter() - started:.0f} s")
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sizes = "default {full}, --quick {quick}"
    for name, help_text in (
        ("streams", "streams per configuration in parts 1 and 2"),
        ("concurrency", "streams open at once in parts 1 and 2"),
        ("output-tokens", "tokens per stream"),
        ("idle-streams", "streams held open in part 3"),
        ("rounds", "rounds the configurations take turns in, parts 1 and 2"),
    ):
        key = name.replace("-", "_")
        parser.add_argument(
            f"--{name}",
            type=int,
            help=f"{help_text} ({sizes.format(full=FULL[key], quick=QUICK[key])})",
        )
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="engine token delay")
    parser.add_argument("--quick", action="store_true", help="small sizes: under a minute")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the OS place the processes (default: gateway on its own CPU)",
    )
    # The gateway child's own arguments.
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-url", help=argparse.SUPPRESS)
    parser.add_argument("--ping-interval-s", type=float, default=15.0, help=argparse.SUPPRESS)
    parser.add_argument("--max-in-flight", type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument("--moderation", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        raise_open_file_limit()
        import uvloop  # as `tandem up` runs the gateway (gateway/cli/main.py)

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args))
        return
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
