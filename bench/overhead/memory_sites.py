"""Where a gateway's memory per open stream goes: tracemalloc's growth under load, by site.

``python -m bench.overhead.memory_sites [--concurrency 16] [--duration-s 12] [--prompt-words
100] [--top 20]``
starts the fake engine and ``tandem up`` (colocated; auth, quotas, fair queue and billing on)
under tracemalloc (``memory_entry.py``). It runs the load once to warm every cache, takes a
snapshot idle, then one while ``--concurrency`` clients stream, and prints the growth between
the two per client connection the gateway holds open then, split into what a full collection
leaves (still referenced) and what it frees (cyclic garbage awaiting the collector): by the
package that allocated, by the type of the objects the collector tracks (a type with more
objects than connections is kept past its request), and by allocation site, each with the
nearest Tandem frame that asked for it.

Python objects only: what C code allocates with malloc itself (libuv's handles, the HTTP
parsers' state) and the allocator's slack are in the RSS that ``python -m bench.overhead``
reports, not here. tracemalloc slows the gateway several times,
so more events wait in its buffers than without it: read the shares, not the exact bytes.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import psutil

from bench.overhead.fake_vllm import Timing
from bench.overhead.memory_entry import SNAPSHOTS_ENV
from bench.overhead.scaling_load import LoadArgs, load_default
from bench.overhead.servers import wrapped_tandem_over_fake

MODEL = "fake-model"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class Site:
    """One allocation site's growth between two snapshots."""

    where: str
    """``file:line`` of the allocation (the innermost frame)."""
    caller: str
    """``file:line`` of the innermost frame in this repository (the Tandem code that asked),
    or ``-`` when none of the recorded frames is."""
    package: str
    """Who allocated: a top-level folder of this repository, a site-packages distribution's
    folder, or ``stdlib``."""
    size: int
    """Bytes grown."""
    blocks: int
    """Memory blocks grown (objects, mostly)."""


def package_of(filename: str) -> str:
    """The package a source file belongs to (see ``Site.package``)."""
    path = Path(filename)
    parts = path.parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1].removesuffix(".py")
    if path.is_absolute() and path.is_relative_to(REPO):
        return path.relative_to(REPO).parts[0].removesuffix(".py")
    if filename.startswith("<"):
        return filename
    return "stdlib"


def _short(frame: tracemalloc.Frame) -> str:
    path = Path(frame.filename)
    if path.is_absolute() and path.is_relative_to(REPO):
        return f"{path.relative_to(REPO)}:{frame.lineno}"
    return f"{'/'.join(path.parts[-2:])}:{frame.lineno}"


def growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot) -> list[Site]:
    """Every allocation site that grew from ``before`` to ``after``, largest first."""
    sites = []
    for stat in after.compare_to(before, "traceback"):
        if stat.size_diff <= 0:
            continue
        frames = list(stat.traceback)  # oldest first, the allocation last
        inner = frames[-1]
        ours = [frame for frame in frames if _ours(frame)]
        caller = _short(ours[-1]) if ours else "-"
        sites.append(
            Site(_short(inner), caller, package_of(inner.filename), stat.size_diff, stat.count_diff)
        )
    return sorted(sites, key=lambda site: -site.size)


def _ours(frame: tracemalloc.Frame) -> bool:
    """A frame of Tandem's own code: in this repository, not in its venv, not the bench's."""
    path = Path(frame.filename)
    if not path.is_absolute() or not path.is_relative_to(REPO) or "site-packages" in path.parts:
        return False
    return path.relative_to(REPO).parts[0] not in ("bench", "tests")


def by_package(sites: Sequence[Site]) -> list[tuple[str, int]]:
    """Bytes grown per package, largest first."""
    totals: Counter[str] = Counter()
    for site in sites:
        totals[site.package] += site.size
    return totals.most_common()


def open_connections(pid: int, port: int) -> int:
    """Client connections the gateway process holds open on ``port`` (accepted, so each has
    its protocol objects, whether its request is streaming, queued or not yet parsed)."""
    return sum(
        1
        for conn in psutil.Process(pid).net_connections(kind="tcp")
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_ESTABLISHED
    )


@dataclass(frozen=True, slots=True)
class Heap:
    """One ``memory_entry`` dump: the heap as it was, after a full collection, and the objects
    the collector tracks by type then."""

    as_is: tracemalloc.Snapshot
    collected: tracemalloc.Snapshot
    types: dict[str, int]


def _heap(pid: int, path: Path, timeout_s: float = 60.0) -> Heap:
    """The gateway's heap now (``memory_entry`` writes it on SIGUSR1)."""
    signal_sent = time.monotonic()
    os.kill(pid, signal.SIGUSR1)
    types = Path(f"{path}.types")
    while not types.exists():  # the last of the three written
        if time.monotonic() - signal_sent > timeout_s:
            raise RuntimeError(f"the gateway wrote no snapshot to {path} in {timeout_s:.0f} s")
        time.sleep(0.1)
    return Heap(
        tracemalloc.Snapshot.load(str(path)),
        tracemalloc.Snapshot.load(f"{path}.collected"),
        orjson.loads(types.read_bytes()),
    )


def type_growth(before: dict[str, int], after: dict[str, int]) -> list[tuple[str, int]]:
    """Objects gained per type, most first (none lost)."""
    grown = Counter({name: count - before.get(name, 0) for name, count in after.items()})
    return [(name, count) for name, count in grown.most_common() if count > 0]


def _load(
    url: str, key: str, args: argparse.Namespace, duration_s: float
) -> subprocess.Popen[bytes]:
    load = LoadArgs(
        url, key, MODEL, args.concurrency, time.time(), warmup_s=0, duration_s=duration_s,
        prompt_words=args.prompt_words,
    )  # fmt: skip
    return subprocess.Popen(load.command(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(load: subprocess.Popen[bytes]) -> str:
    """Wait for the load generator; its report (one JSON line)."""
    out, err = load.communicate(timeout=300)
    if load.returncode != 0:
        raise RuntimeError(f"the load generator failed: {err.decode(errors='replace')[-2000:]}")
    return out.decode().strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead.memory_sites")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="clients (under tracemalloc one core of a 2-core host keeps up with about 16: "
        "at 128 clients it held 23 connections open)",
    )
    parser.add_argument("--duration-s", type=float, default=12.0)
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=load_default("prompt_words"),
        help="words in each request's prompt (about 6 bytes a word)",
    )
    parser.add_argument("--top", type=int, default=20, help="allocation sites shown")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tandem-memory-sites-") as tmp:
        prefix = Path(tmp) / "snapshot"
        with wrapped_tandem_over_fake(
            Path(tmp), Timing(), MODEL, "bench.overhead.memory_entry", {SNAPSHOTS_ENV: str(prefix)}
        ) as (gateway, key):
            _finish(_load(gateway.url, key, args, 5.0))  # every cache warm
            time.sleep(2.0)
            idle = _heap(gateway.pid, Path(f"{prefix}.0"))
            load = _load(gateway.url, key, args, args.duration_s)
            time.sleep(1.0 + args.duration_s / 2)  # past the stagger: every stream open
            port = urlsplit(gateway.url).port
            assert port is not None
            streams = open_connections(gateway.pid, port)
            loaded = _heap(gateway.pid, Path(f"{prefix}.1"))
            report = _finish(load)
    if streams < 1:
        raise RuntimeError("no stream was open when the loaded snapshot was taken")
    per = 1024 * streams
    held = growth(idle.collected, loaded.collected)
    garbage = growth(loaded.collected, loaded.as_is)
    print(f"load: {report}")
    print(
        f"Python objects grown with {streams} client connections open ({args.concurrency} "
        f"clients), per connection: {_total(held) / per:.1f} KiB still referenced after a full "
        f"collection, {_total(garbage) / per:.1f} KiB more awaiting the collector"
    )
    print(f"\n{'package':28} {'KiB/conn':>10}  (still referenced)")
    for package, size in by_package(held):
        if size / per >= 0.05:
            print(f"{package:28} {size / per:>10.2f}")
    print(f"\n{'objects/conn':>12}  type (tracked by the collector, still referenced)")
    for name, count in type_growth(idle.types, loaded.types)[: args.top]:
        print(f"{count / streams:>12.1f}  {name}")
    for title, sites in (("still referenced", held), ("awaiting the collector", garbage)):
        print(
            f"\n{'KiB/conn':>10} {'blocks':>7}  {'allocated at (' + title + ')':56} Tandem caller"
        )
        for site in sites[: args.top]:
            print(
                f"{site.size / per:>10.2f} {site.blocks / streams:>7.1f}  {site.where:56} "
                f"{site.caller}"
            )


def _total(sites: Sequence[Site]) -> int:
    return sum(site.size for site in sites)


if __name__ == "__main__":
    main()
