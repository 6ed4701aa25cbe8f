"""NIXL READ throughput by UCX transport, without vLLM: which ``UCX_TLS`` moves KV fastest here.

    python -m bench.kv_transfer.ucx_transports [--tls tcp --tls sm,tcp ...] [--repeats 10]

Two processes, as a prefill and a decode worker are: the *holder* registers a KV cache laid out
as vLLM's CPU attention backend lays it out (one region per layer, one page per block holding the
block's K and V for that layer's KV heads), the *reader* registers its own and READs the blocks
of one prompt, one descriptor per layer and block, as vLLM's NixlConnector does on a decode
worker. Both agents get the progress-thread delay the pools give workers
(``kv_transfer.nixl_progress``). The geometry is the prepared model's (``kv_transfer.geometry``;
the bundled SmolLM2 with 128-token blocks unless ``--model-dir``), for prompts of 256, 1k, 2k and
4k tokens. Each transfer is checked byte for byte against what the holder wrote.

Each ``UCX_TLS`` runs in a fresh pair of processes (UCX reads it once, when the backend starts).
A setting UCX cannot serve here is reported as failed, with UCX's reason, not skipped silently.
Next to each READ the reader times a memcpy of the same bytes (contiguous, numpy, as
``transfer.py`` does): on a shared machine both then see the same load; medians of each.
``--proto-info`` makes UCX print the protocol it picked per operation and size (UCX_PROTO_INFO).
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.kv_transfer.transfer import SIZES
from kv_transfer.geometry import KvGeometry
from kv_transfer.nixl_progress import install

DEFAULT_TLS = ("tcp", "posix", "sysv", "cma", "sm", "sm,tcp", "sm,cma,tcp", "all")
"""``all`` leaves ``UCX_TLS`` unset: UCX's own default, what workers had before issue 24."""
PROGRESS_DELAY_US = 1000  # what the pools give workers (ConnectorConfig.progress_delay_us)
_SEED = 24


@dataclass(frozen=True, slots=True)
class Layout:
    """One side's KV cache: ``num_layers`` regions of ``num_blocks`` pages, back to back."""

    num_layers: int
    num_blocks: int
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_layers * self.num_blocks * self.page_bytes

    def descs(self, base: int, num_blocks: int, per_block: bool) -> np.ndarray:
        """(address, length, device) rows for blocks ``0..num_blocks-1`` of every layer: one per
        layer (vLLM merges a layer's contiguous blocks: its log shows 30 descriptors per
        transfer) or one per layer and block."""
        if not per_block:
            starts = np.arange(self.num_layers, dtype=np.uint64) * self.num_blocks
            rows = np.zeros((self.num_layers, 3), dtype=np.uint64)
            rows[:, 0], rows[:, 1] = base + starts * self.page_bytes, num_blocks * self.page_bytes
            return rows
        layers = np.repeat(np.arange(self.num_layers, dtype=np.uint64), num_blocks)
        blocks = np.tile(np.arange(num_blocks, dtype=np.uint64), self.num_layers)
        addrs = base + (layers * self.num_blocks + blocks) * self.page_bytes
        rows = np.zeros((len(addrs), 3), dtype=np.uint64)
        rows[:, 0], rows[:, 1] = addrs, self.page_bytes
        return rows

    def offsets(self, num_blocks: int) -> list[slice]:
        """The byte ranges ``descs`` covers, for checking what arrived."""
        span = num_blocks * self.page_bytes
        starts = (layer * self.num_blocks * self.page_bytes for layer in range(self.num_layers))
        return [slice(start, start + span) for start in starts]


@dataclass(frozen=True, slots=True)
class Row:
    tls: str
    threads: int
    tokens: int
    num_bytes: int
    xfer_s: float
    memcpy_s: float
    error: str = ""

    def render(self) -> str:
        if self.error:
            return f"{self.tls:<12} {self.threads:>7} {self.tokens:>6}  failed: {self.error}"
        gbps = self.num_bytes / self.xfer_s / 1e9
        share = self.memcpy_s / self.xfer_s
        return (
            f"{self.tls:<12} {self.threads:>7} {self.tokens:>6} {self.num_bytes / 1e6:>7.1f} "
            f"{self.xfer_s * 1e3:>8.2f} {gbps:>6.2f} {self.memcpy_s * 1e3:>9.2f} "
            f"{self.num_bytes / self.memcpy_s / 1e9:>9.2f} {share:>8.0%}"
        )


HEADER = (
    f"{'UCX_TLS':<12} {'threads':>7} {'tokens':>6} {'KV MB':>7} {'xfer ms':>8} {'GB/s':>6} "
    f"{'memcpy ms':>9} {'memcpy GB/s':>9} {'of memcpy':>8}"
)


@dataclass(frozen=True, slots=True)
class Setup:
    """What every holder/reader pair of one run shares."""

    layout: Layout
    sizes: tuple[int, ...]
    repeats: int
    block_size: int
    per_block: bool
    pinned: bool
    """Holder on core 0, reader on core 1, as ``tandem up`` binds its two workers."""
    proto_info: bool


def _agent(name: str, tls: str, threads: int, setup: Setup, core: int) -> Any:
    """A NIXL agent with the UCX backend as vLLM creates it (``num_threads``, telemetry on),
    created after ``UCX_TLS`` is in place, on ``core`` where the run is pinned (NIXL's threads
    inherit it, as in a pinned worker)."""
    if setup.pinned:
        os.sched_setaffinity(0, {core % (os.cpu_count() or 1)})
    if tls != "all":
        os.environ["UCX_TLS"] = tls
    if setup.proto_info:
        os.environ["UCX_PROTO_INFO"] = "y"
    api = importlib.import_module("nixl._api")
    install(api, PROGRESS_DELAY_US)
    config = api.nixl_agent_config(num_threads=threads, capture_telemetry=True)
    return api.nixl_agent(name, config)


def _fill(layout: Layout) -> np.ndarray:
    return np.random.default_rng(_SEED).integers(0, 256, layout.nbytes, dtype=np.uint8)


def holder(pipe: Connection, tls: str, threads: int, setup: Setup) -> None:
    """The prefill side: registers a filled KV cache, publishes it, waits to be told to stop."""
    try:
        agent = _agent("holder", tls, threads, setup, core=0)
        cache = _fill(setup.layout)
        base = cache.ctypes.data
        agent.register_memory([(base, setup.layout.nbytes, 0, "")], "DRAM")
        pipe.send((agent.get_agent_metadata(), base))
    # NIXL's errors (nixlBackendError, ...) derive from Exception directly; a setting that fails
    # is a result, reported in the table with its reason.
    except Exception as error:  # noqa: BLE001
        pipe.send(error)
        return
    pipe.recv()


def reader(pipe: Connection, tls: str, threads: int, setup: Setup) -> None:
    """The decode side: READs each prompt's blocks; sends (tokens, READ s, memcpy s) medians."""
    layout = setup.layout
    try:
        metadata, remote_base = pipe.recv()
        agent = _agent("reader", tls, threads, setup, core=1)
        cache = np.zeros(layout.nbytes, dtype=np.uint8)
        base = cache.ctypes.data
        agent.register_memory([(base, layout.nbytes, 0, "")], "DRAM")
        peer = agent.add_remote_agent(metadata)
        agent.make_connection(peer)
        expected = _fill(layout)
        results: list[tuple[int, float, float]] = []
        for tokens in setup.sizes:
            num_blocks = -(-tokens // setup.block_size)
            local = agent.get_xfer_descs(layout.descs(base, num_blocks, setup.per_block), "DRAM")
            remote = agent.get_xfer_descs(
                layout.descs(remote_base, num_blocks, setup.per_block), "DRAM"
            )
            handle = agent.initialize_xfer("READ", local, remote, peer)
            source = np.ones(layout.num_layers * num_blocks * layout.page_bytes, np.uint8)
            target = np.zeros_like(source)
            times, copies = [], []
            for attempt in range(setup.repeats + 1):  # the first warms the path up
                cache[:] = 0
                # A memcpy of the same bytes next to each READ: on a shared machine both then
                # see the same load.
                start = time.perf_counter()
                np.copyto(target, source)
                copied = time.perf_counter() - start
                start = time.perf_counter()
                state = agent.transfer(handle)
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                elapsed = time.perf_counter() - start
                if state != "DONE":
                    raise RuntimeError(f"transfer of {tokens} tokens ended in state {state}")
                for part in layout.offsets(num_blocks):
                    if not np.array_equal(cache[part], expected[part]):
                        raise RuntimeError(f"{tokens} tokens: the bytes read differ")
                if attempt:
                    times.append(elapsed)
                    copies.append(copied)
            agent.release_xfer_handle(handle)
            results.append((tokens, statistics.median(times), statistics.median(copies)))
        pipe.send(results)
    # NIXL's errors (nixlBackendError, ...) derive from Exception directly; a setting that fails
    # is a result, reported in the table with its reason.
    except Exception as error:  # noqa: BLE001
        pipe.send(error)


def measure(tls: str, threads: int, setup: Setup) -> list[Row]:
    """One ``UCX_TLS`` setting in a fresh holder/reader pair."""
    context = mp.get_context("spawn")
    holder_end, holder_pipe = context.Pipe()
    reader_end, reader_pipe = context.Pipe()
    held = context.Process(target=holder, args=(holder_pipe, tls, threads, setup))
    read = context.Process(target=reader, args=(reader_pipe, tls, threads, setup))
    held.start()
    read.start()

    def failed(reason: str) -> list[Row]:
        return [Row(tls, threads, tokens, 0, 0, 0, reason) for tokens in setup.sizes]

    try:
        published = holder_end.recv()
        if isinstance(published, Exception):
            return failed(f"holder: {published}")
        reader_end.send(published)
        outcome = reader_end.poll(300) and reader_end.recv()
        if not outcome or isinstance(outcome, Exception):
            return failed(f"reader: {outcome}" if outcome else "reader: no answer in 300 s")
        rows = []
        for tokens, seconds, memcpy_s in outcome:
            num_blocks = -(-tokens // setup.block_size)
            num_bytes = setup.layout.num_layers * num_blocks * setup.layout.page_bytes
            rows.append(Row(tls, threads, tokens, num_bytes, seconds, memcpy_s))
        return rows
    finally:
        holder_end.send("stop")
        for process in (read, held):
            process.join(30)
            if process.is_alive():
                process.kill()


def geometry_of(model_dir: Path | None, dtype: str, block_size: int) -> KvGeometry:
    """The prepared model's KV geometry, or the bundled SmolLM2's where none is found."""
    if model_dir is None:
        from workers.model import find_prepared

        prepared = find_prepared()
        model_dir = None if prepared is None else prepared.path
    if model_dir is not None:
        found = KvGeometry.of_model_dir(model_dir, dtype=dtype, block_size=block_size)
        if found is not None:
            return found
    smollm2 = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
    return KvGeometry(**smollm2, dtype_bytes=4 if dtype == "float32" else 2, block_size=block_size)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_transfer.ucx_transports")
    parser.add_argument("--tls", action="append", help=f"UCX_TLS values (default {DEFAULT_TLS})")
    parser.add_argument("--tokens", type=int, action="append", help=f"default {SIZES}")
    parser.add_argument(
        "--threads", type=int, action="append",
        help="NIXL UCX backend num_threads (default 4, vLLM's; 0 is NIXL's own)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=128, help="vLLM's on CPU")
    parser.add_argument("--dtype", default="float32", help="the workers' (TANDEM_DTYPE)")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument(
        "--per-block", action="store_true",
        help="one descriptor per layer and block (default: per layer, as vLLM merges them)",
    )  # fmt: skip
    parser.add_argument("--pin", action="store_true", help="holder on core 0, reader on core 1")
    parser.add_argument("--proto-info", action="store_true", help="UCX prints its protocols")
    args = parser.parse_args(argv)
    geometry = geometry_of(args.model_dir, args.dtype, args.block_size)
    sizes = tuple(args.tokens or SIZES)
    layout = Layout(
        geometry.num_layers, -(-max(sizes) // args.block_size),
        geometry.bytes_per_block // geometry.num_layers,
    )  # fmt: skip
    setup = Setup(
        layout, sizes, args.repeats, args.block_size, args.per_block, args.pin, args.proto_info
    )
    print(
        f"{geometry.num_layers} layers, {layout.page_bytes} B per layer and block "
        f"({args.block_size} tokens, {args.dtype}); one descriptor per layer"
        f"{' and block' if args.per_block else ''}; {'pinned' if args.pin else 'unpinned'}; "
        f"median of {args.repeats} READs, each next to a memcpy of the same bytes (numpy)"
    )
    print(HEADER, flush=True)
    for tls in args.tls or DEFAULT_TLS:
        for threads in args.threads or (4,):
            for row in measure(tls, threads, setup):
                print(row.render(), flush=True)


if __name__ == "__main__":
    main()
