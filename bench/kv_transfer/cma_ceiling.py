"""The ceiling of a same-host KV read, without NIXL or vLLM: process_vm_readv by cores and pages.

    python -m bench.kv_transfer.cma_ceiling [--mib 177] [--iov-kib 6144] [--threads 1 ...]
                                            [--pages huge --pages small]

A decode worker READs a same-host prefill worker's KV by CMA (``process_vm_readv``: one kernel
copy, UCX's ``cma`` transport; docs/ARCHITECTURE.md, KV transport), in the thread that posts the
transfer. This measures that copy alone: a *holder* process fills a buffer (``--mib``, default
one 4k-token prompt's KV for the bundled model), the reader copies it into its own with
``process_vm_readv`` split over N threads, each bound to a core of its own and reading its slice
with iovecs of ``--iov-kib`` (vLLM's descriptors are one 128-token block each). Both buffers are
mapped with transparent huge pages asked for (``madvise(MADV_HUGEPAGE)``, what
``THP_MEM_ALLOC_ENABLE`` makes torch do for a worker's KV cache) or not: the kernel pins and
maps the holder's pages for every call, 512 times fewer of them when they are huge. Next to it,
a memcpy of the same bytes between the same kind of buffers in one thread (numpy, as
``transfer.py`` and ``ucx_transports.py`` time it). Best of ``--repeats`` each; the copy is
checked byte for byte against the holder's, and the holder's huge-page share is printed (the
kernel may grant fewer than asked: ``/sys/kernel/mm/transparent_hugepage/enabled``).

It answers how many cores, and which pages, a transfer needs to reach a given share of memcpy's
speed on this host: no transport setting takes a read on one core past its one-thread figure.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Literal

import numpy as np

from bench.kv_transfer.transfer import best_copy_seconds

IOV_MAX = 1024
"""Linux's limit on iovecs per process_vm_readv call (UIO_MAXIOV)."""
_PATTERN = 251  # a prime: a slice copied to the wrong offset does not match by chance
_HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4k base pages) transparent huge page


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around each call
_libc.process_vm_readv.restype = ctypes.c_ssize_t


Pages = Literal["huge", "small"]
PAGES: tuple[Pages, ...] = ("huge", "small")


def pattern(nbytes: int) -> np.ndarray:
    """The holder's bytes: position modulo a prime (one period, repeated)."""
    return np.resize(np.arange(_PATTERN, dtype=np.uint8), nbytes)


def mapped(nbytes: int, pages: Pages) -> tuple[mmap.mmap, np.ndarray]:
    """A private anonymous mapping, huge pages asked for or not, and a byte view of
    ``nbytes`` of it starting on a huge-page boundary (keep the mapping referenced as long as
    the view is used). numpy's own large allocations ask for huge pages, and Python's default
    anonymous mapping is shared memory, which THP leaves alone: hence an explicit one."""
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE if pages == "huge" else mmap.MADV_NOHUGEPAGE)
    whole = np.frombuffer(region, dtype=np.uint8)
    start = -whole.ctypes.data % _HUGE_PAGE
    return region, whole[start : start + nbytes]


def huge_bytes(pid: int) -> int:
    """Bytes of ``pid``'s anonymous memory on transparent huge pages."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return 0


def hold(conn: Connection, nbytes: int, pages: Pages) -> None:
    """The holder: fill a buffer, tell the reader where it is, keep it until told to go."""
    region, view = mapped(nbytes, pages)
    np.copyto(view, pattern(nbytes))
    conn.send((os.getpid(), view.ctypes.data))
    conn.recv()
    del view
    region.close()


@dataclass(frozen=True, slots=True)
class Slice:
    """One thread's part of the copy: its iovecs, read in calls of at most ``IOV_MAX``, and
    the bytes each call must return (summed here, not in the timed loop)."""

    pid: int
    local: ctypes.Array[_Iovec]
    remote: ctypes.Array[_Iovec]
    call_bytes: tuple[int, ...]

    @classmethod
    def of(
        cls, pid: int, local_base: int, remote_base: int, start: int, end: int, iov_bytes: int
    ) -> Slice:
        offsets = range(start, end, iov_bytes)
        lengths = [min(iov_bytes, end - offset) for offset in offsets]
        local = (_Iovec * len(lengths))(
            *(_Iovec(local_base + o, n) for o, n in zip(offsets, lengths, strict=True))
        )
        remote = (_Iovec * len(lengths))(
            *(_Iovec(remote_base + o, n) for o, n in zip(offsets, lengths, strict=True))
        )
        calls = tuple(sum(lengths[i : i + IOV_MAX]) for i in range(0, len(lengths), IOV_MAX))
        return cls(pid, local, remote, calls)

    def read(self) -> None:
        size = ctypes.sizeof(_Iovec)
        count = len(self.local)
        for call, expected in enumerate(self.call_bytes):
            first = call * IOV_MAX
            n = min(IOV_MAX, count - first)
            local = ctypes.byref(self.local, first * size)
            remote = ctypes.byref(self.remote, first * size)
            got = _libc.process_vm_readv(self.pid, local, n, remote, n, 0)
            if got != expected:
                code = ctypes.get_errno()
                hint = (
                    " (CMA needs ptrace rights over the holder: run as its user with "
                    "kernel.yama.ptrace_scope <= 1, or as root)"
                    if code == errno.EPERM
                    else ""
                )
                raise OSError(code, f"process_vm_readv read {got} of {expected} B{hint}")


def timed_read(slices: list[Slice], cores: list[int]) -> float:
    """Seconds for every slice to be read, each by a thread bound to its own core."""
    ready = threading.Barrier(len(slices) + 1)
    failures: list[OSError] = []  # anything else a thread raises, the byte check finds

    def run(piece: Slice, core: int) -> None:
        os.sched_setaffinity(0, {core})  # on Linux, 0 is the calling thread
        ready.wait()
        try:
            piece.read()
        except OSError as exc:
            failures.append(exc)

    threads = [
        threading.Thread(target=run, args=(piece, core))
        for piece, core in zip(slices, cores, strict=False)
    ]
    for thread in threads:
        thread.start()
    ready.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    if failures:
        raise failures[0]
    return elapsed


@dataclass(frozen=True, slots=True)
class Row:
    pages: Pages
    threads: int
    iov_bytes: int
    nbytes: int
    seconds: float
    memcpy_s: float
    holder_huge_bytes: int

    def render(self) -> str:
        gbps = self.nbytes / self.seconds / 1e9
        share = self.memcpy_s / self.seconds * 100
        huge = min(100.0, self.holder_huge_bytes / self.nbytes * 100)  # its heap's count too
        return (
            f"{self.pages:>5} {huge:>5.0f}% {self.threads:>7} {self.iov_bytes >> 10:>8} "
            f"{self.nbytes / 1e6:>7.1f} {self.seconds * 1e3:>8.2f} {gbps:>6.2f} "
            f"{self.memcpy_s * 1e3:>9.2f} {share:>8.0f}%"
        )


HEADER = (
    f"{'pages':>5} {'huge':>6} {'threads':>7} {'iov KiB':>8} {'MB':>7} {'read ms':>8} "
    f"{'GB/s':>6} {'memcpy ms':>9} {'of memcpy':>9}"
)


def measure(
    nbytes: int, iov_bytes: int, thread_counts: list[int], pages: Pages, repeats: int
) -> list[Row]:
    """One row per thread count: the best read of ``nbytes`` from a holder process, both
    sides' buffers on ``pages``."""
    cores = sorted(os.sched_getaffinity(0))
    if max(thread_counts) > len(cores):
        raise SystemExit(
            f"--threads {max(thread_counts)} needs as many cores; this process may use "
            f"{len(cores)} ({cores})"
        )
    context = mp.get_context("spawn")  # a fresh process, as a worker is
    here, there = context.Pipe()
    holder = context.Process(target=hold, args=(there, nbytes, pages), daemon=True)
    holder.start()
    region, target = mapped(nbytes, pages)
    try:
        pid, remote_base = here.recv()
        held_huge = huge_bytes(pid)
        target.fill(1)  # touched: the reads measure copying, not first-touch page faults
        local_base = target.ctypes.data
        expected = pattern(nbytes)
        seconds = []
        for count in thread_counts:
            bounds = [nbytes * i // count for i in range(count + 1)]
            slices = [
                Slice.of(pid, local_base, remote_base, bounds[i], bounds[i + 1], iov_bytes)
                for i in range(count)
            ]
            seconds.append(min(timed_read(slices, cores) for _ in range(repeats)))
            if not np.array_equal(target, expected):
                raise AssertionError(f"{count} threads: the copy differs from the holder's bytes")
            target.fill(1)
        source_region, source = mapped(nbytes, pages)
        np.copyto(source, expected)
        memcpy_s = best_copy_seconds(source, target, repeats)
        del source
        source_region.close()
        return [
            Row(pages, count, iov_bytes, nbytes, best, memcpy_s, held_huge)
            for count, best in zip(thread_counts, seconds, strict=True)
        ]
    finally:
        del target
        region.close()
        here.send("done")
        holder.join(10)
        if holder.is_alive():
            holder.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer.cma_ceiling")
    parser.add_argument("--mib", type=float, default=177.0, help="bytes read, in MiB")
    parser.add_argument("--iov-kib", type=int, default=6144, help="bytes per iovec, in KiB")
    parser.add_argument(
        "--threads", type=int, action="append",
        help="reader threads, each on a core of its own (default: 1, 2, ... every core)",
    )  # fmt: skip
    parser.add_argument(
        "--pages", choices=PAGES, action="append", help=f"buffers' pages (default {PAGES})"
    )
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    counts = args.threads or list(range(1, len(os.sched_getaffinity(0)) + 1))
    if min(counts) < 1 or args.iov_kib < 1 or args.mib <= 0 or args.repeats < 1:
        parser.error("--threads, --iov-kib, --mib and --repeats must be positive")
    nbytes = int(args.mib * 2**20)
    print(
        f"process_vm_readv of {nbytes / 1e6:.1f} MB from a holder process, best of "
        f"{args.repeats}; memcpy: numpy, one thread; huge: the holder's share on huge pages",
        flush=True,
    )
    print(HEADER)
    for pages in args.pages or PAGES:
        for row in measure(nbytes, args.iov_kib << 10, counts, pages, args.repeats):
            print(row.render(), flush=True)


if __name__ == "__main__":
    main()
