"""Streams/s served by 1, 2, ... gateway processes on as many cores (issue 24: "every core").

``python -m bench.overhead.scaling --processes 1,2,4`` starts fake decode engines and load
generators on cores of their own, then for each N runs ``tandem up --gateway-workers N``
(colocated path, auth, quotas, fair queue and billing on; above one process the shared stores
are the ``redis-server`` it starts) pinned to N cores, the Redis included, and loads it with
``--concurrency-per-process`` streams per process for the measured window. It prints, per N:
streams/s, the cores the gateway's process tree used, its CPU per request, the speed-up over
one process, and how busy the busiest engine and generator were (a figure near 100% there
means the run measured them, not the gateway).

``--redis-core`` gives the shared ``redis-server`` a core of its own (moved there once ``tandem
up`` started it; by default it shares the gateway's cores, as ``tandem up`` runs it): the
gateway's figures then leave out the two's contention for a core (Redis's CPU still counts
in them).

``--redis-at-one`` runs the one-process level over a ``redis-server`` too (started as ``tandem
up`` starts one, pinned to that process's core, its CPU counted): the speed-up then measures
the processes alone, not also the step from in-memory stores to shared ones.

The load comes from several processes (``bench/overhead/scaling_load.py``), started with one
shared start time, because a single Python client saturates near what one gateway process
serves. It needs ``N + engines + generators + 1`` cores (the last for this process and the
fake prefill worker), one more with ``--redis-core``; on fewer, ``--no-pin`` runs everything
unpinned, which measures the machine, not the scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from bench.overhead.fake_vllm import Timing
from bench.overhead.procs import Server, process_tree_cpu_times, spawn, start_fake_engine
from bench.overhead.scaling_load import LoadArgs
from bench.overhead.servers import TandemSetup, start_tandem
from gateway.assembly.redis_server import OwnedRedis

MODEL = "fake-model"
BOOT_S = 4.0
"""Time for the generators to import and connect before the shared start."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Which cores each part of the run gets (None everywhere: unpinned)."""

    gateway: list[frozenset[int] | None]
    """Index N-1: the cores for N gateway processes."""
    engines: list[frozenset[int] | None]
    generators: list[frozenset[int] | None]
    rest: frozenset[int] | None
    redis: frozenset[int] | None = None
    """The shared Redis's own core (None: it runs on the gateway's)."""

    @staticmethod
    def plan(
        max_processes: int, engines: int, generators: int, pin: bool, redis_core: bool = False
    ) -> Layout:
        if not pin:
            return Layout([None] * max_processes, [None] * engines, [None] * generators, None)
        cores = sorted(os.sched_getaffinity(0))
        redis = int(redis_core)
        needed = max_processes + redis + engines + generators + 1
        if len(cores) < needed:
            raise SystemExit(
                f"this run needs {needed} cores ({max_processes} gateway, {redis} Redis, "
                f"{engines} engines, {generators} generators, 1 for the rest) and {len(cores)} "
                "are available: use fewer, or --no-pin (which measures the machine, not the "
                "scaling)"
            )
        engine_at = max_processes + redis
        generator_at = engine_at + engines
        return Layout(
            gateway=[frozenset(cores[:n]) for n in range(1, max_processes + 1)],
            engines=[frozenset({cores[engine_at + i]}) for i in range(engines)],
            generators=[frozenset({cores[generator_at + i]}) for i in range(generators)],
            rest=frozenset(cores[needed - 1 :]),
            redis=frozenset({cores[max_processes]}) if redis_core else None,
        )


@dataclass(slots=True)
class ScalingRow:
    processes: int
    concurrency: int
    streams_per_s: float
    failed: int
    errors: dict[str, int]
    chunks_per_stream: float
    gateway_cores_busy: float
    """The gateway's process tree (Redis included): CPU seconds per wall second."""
    redis_cores_busy: float
    """The part of ``gateway_cores_busy`` that is the ``redis-server`` alone."""
    gateway_cpu_ms_per_request: float
    busiest_engine: float
    busiest_generator: float
    speedup: float = 1.0


def _parse_levels(text: str) -> list[int]:
    return sorted({int(part) for part in text.split(",") if part.strip()})


def _cpu_s(servers: Sequence[Server]) -> list[float]:
    return [server.cpu_seconds() for server in servers]


def redis_cpu_s(gateway: Server, redis: OwnedRedis | None = None) -> float:
    """CPU seconds so far of the ``redis-server`` the gateway's ``tandem up`` started, or of
    ``redis`` (0 when there is none): the share of the gateway's cores the shared stores take
    themselves."""
    if redis is not None and redis.pid is not None:
        times = psutil.Process(redis.pid).cpu_times()
        return float(times.user + times.system)
    return sum(process_tree_cpu_times(gateway.pid, named="redis-server"))


@contextlib.contextmanager
def redis_at_one(
    processes: int, args: argparse.Namespace, layout: Layout, work_dir: Path
) -> Iterator[OwnedRedis | None]:
    """With ``--redis-at-one``, for one process: a ``redis-server`` on its core (or on
    ``--redis-core``'s); else None."""
    if processes != 1 or not args.redis_at_one:
        yield None
        return
    redis = OwnedRedis(work_dir / "redis-at-one")
    loop = asyncio.new_event_loop()  # the server outlives each call: one loop for both
    try:
        loop.run_until_complete(redis.start())
        cores = layout.redis or layout.gateway[0]
        if cores is not None and redis.pid is not None:
            os.sched_setaffinity(redis.pid, cores)
        yield redis
    finally:
        loop.run_until_complete(redis.aclose())
        loop.close()


def redis_pids(gateway: Server) -> list[int]:
    """The ``redis-server`` processes the gateway's ``tandem up`` started."""
    try:
        children = psutil.Process(gateway.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [child.pid for child in children if "redis-server" in child.name()]


def measure(
    processes: int,
    args: argparse.Namespace,
    layout: Layout,
    prefill: Server,
    decodes: Sequence[Server],
    work_dir: Path,
    redis: OwnedRedis | None,
) -> ScalingRow:
    setup = TandemSetup(
        two_legs=False,
        gateway_workers=processes,
        max_in_flight_per_worker=max(4096, 2 * args.concurrency_per_process * processes),
        redis_url=None if redis is None else redis.url,
    )
    gateway, api_key = start_tandem(
        setup,
        prefill.url,
        decodes[0].url,
        MODEL,
        work_dir,
        layout.gateway[processes - 1],
        more_decode_urls=[d.url for d in decodes[1:]],
    )
    if layout.redis is not None:
        for pid in redis_pids(gateway):
            os.sched_setaffinity(pid, layout.redis)
    concurrency = args.concurrency_per_process * processes
    generators: list[subprocess.Popen[bytes]] = []
    try:
        start_at = time.time() + BOOT_S
        shares = [concurrency // args.generators] * args.generators
        shares[0] += concurrency - sum(shares)
        for index, (share, cores) in enumerate(zip(shares, layout.generators, strict=True)):
            load = LoadArgs(
                gateway.url, api_key, MODEL, share, start_at, warmup_s=args.warmup_s,
                duration_s=args.duration_s, tokens=args.tokens,
            )  # fmt: skip
            process, _ = spawn(
                f"load-{processes}-{index}", load.command(), work_dir, cores, stdout_pipe=True
            )
            generators.append(process)
        window_start = start_at + args.warmup_s
        time.sleep(max(0.0, window_start - time.time()))
        gateway0, redis0 = gateway.cpu_seconds(), redis_cpu_s(gateway, redis)
        engines0 = _cpu_s(decodes)
        time.sleep(args.duration_s)
        redis_s = redis_cpu_s(gateway, redis) - redis0
        # A server of --redis-at-one is no child of the gateway's: its CPU is added.
        gateway_s = gateway.cpu_seconds() - gateway0 + (redis_s if redis is not None else 0.0)
        engines_s = [
            after - before for before, after in zip(engines0, _cpu_s(decodes), strict=True)
        ]
        reports = []
        for process in generators:
            out, _ = process.communicate(timeout=120)
            if process.returncode != 0:
                raise SystemExit(f"a load generator failed ({process.returncode}); see {work_dir}")
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for process in generators:
            if process.poll() is None:
                process.kill()
        gateway.stop()
    completed = sum(r["completed"] for r in reports)
    errors: dict[str, int] = {}
    for report in reports:
        for kind, count in report["errors"].items():
            errors[kind] = errors.get(kind, 0) + count
    return ScalingRow(
        processes=processes,
        concurrency=concurrency,
        streams_per_s=completed / args.duration_s,
        failed=sum(r["failed"] for r in reports),
        errors=errors,
        chunks_per_stream=sum(r["chunks"] for r in reports) / completed if completed else 0.0,
        gateway_cores_busy=gateway_s / args.duration_s,
        redis_cores_busy=redis_s / args.duration_s,
        gateway_cpu_ms_per_request=gateway_s * 1000 / completed if completed else float("nan"),
        busiest_engine=max(engines_s) / args.duration_s,
        busiest_generator=max(r["generator_cpu_s"] / r["window_s"] for r in reports),
    )


def print_rows(rows: Sequence[ScalingRow]) -> None:
    header = (
        f"{'processes':>9} {'streams':>7} {'streams/s':>9} {'speed-up':>8} {'failed':>6} "
        f"{'gw cores':>8} {'of which redis':>14} {'gw ms/req':>9} {'engine max':>10} "
        f"{'generator max':>13}"
    )
    print(header)
    for r in rows:
        print(
            f"{r.processes:>9} {r.concurrency:>7} {r.streams_per_s:>9.1f} {r.speedup:>7.2f}x "
            f"{r.failed:>6} {r.gateway_cores_busy:>8.2f} {r.redis_cores_busy:>14.2f} "
            f"{r.gateway_cpu_ms_per_request:>9.3f} "
            f"{100 * r.busiest_engine:>9.0f}% {100 * r.busiest_generator:>12.0f}%"
            + (f"  errors {r.errors}" if r.errors else "")
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.scaling", description=__doc__)
    parser.add_argument("--processes", default="1,2", help="gateway process counts")
    parser.add_argument("--concurrency-per-process", type=int, default=512)
    parser.add_argument("--engines", type=int, default=2, help="fake decode engines")
    parser.add_argument("--generators", type=int, default=2, help="load generator processes")
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--duration-s", type=float, default=15.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--no-pin", action="store_true")
    parser.add_argument(
        "--redis-at-one", action="store_true", help="one process over Redis too (see above)"
    )
    parser.add_argument(
        "--redis-core", action="store_true", help="Redis on a core of its own (see above)"
    )
    parser.add_argument("--out-json", type=Path)
    args = parser.parse_args(argv)
    levels = _parse_levels(args.processes)
    layout = Layout.plan(
        max(levels), args.engines, args.generators, not args.no_pin, args.redis_core
    )
    # Each open stream holds two sockets in the gateway; children inherit the raised limit.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 1 << 16)), hard))
    if layout.rest is not None:
        os.sched_setaffinity(0, layout.rest)
    timing = Timing(num_tokens=args.tokens, itl_s=args.itl_ms / 1000)
    work_dir = Path(tempfile.mkdtemp(prefix="tandem-scaling-"))
    engines: list[Server] = []
    rows: list[ScalingRow] = []
    try:
        prefill = start_fake_engine("fake-prefill", timing, MODEL, work_dir, layout.rest)
        engines.append(prefill)
        decodes = [
            start_fake_engine(f"fake-decode-{i}", timing, MODEL, work_dir, cores)
            for i, cores in enumerate(layout.engines)
        ]
        engines += decodes
        print(f"cores: {asdict(layout)}", flush=True)
        for processes in levels:
            with redis_at_one(processes, args, layout, work_dir) as redis:
                row = measure(processes, args, layout, prefill, decodes, work_dir, redis)
            row.speedup = row.streams_per_s / rows[0].streams_per_s if rows else 1.0
            rows.append(row)
            print_rows([row])
            sys.stdout.flush()
    finally:
        for engine in engines:
            engine.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
    print()
    print_rows(rows)
    if args.out_json:
        args.out_json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
