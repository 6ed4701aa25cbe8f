"""The figures of an overhead run, from records and CPU readings: pure functions, no I/O.

Definitions (the harness's, i.e. vLLM ``bench serve``'s): TTFT = request sent -> first chunk
with a choice (chat's role chunk counts); ITL = the gap between consecutive chunks with a choice,
pooled over all requests. *Added* latency = the percentile through a server minus the same
percentile sent directly to the engine at the same concurrency (a difference of percentiles,
not a percentile of differences: requests are not paired).

Memory: the server's resident set (process and children) once it is up and idle, and its
peak while a level's streams are open (sampled every 50 ms); per open stream = (peak - idle) /
concurrency, an upper bound (whatever the load grew besides the streams, caches and pools,
counts too). Per added stream = the growth of the peak from the server's level below to this
one, per stream added: the warm-up's one-time growth is in both peaks, so it is left out.

CPU: the server under test's user + system seconds (process and children) over the measured
phase only (warm-up excluded), less its idle rate (measured before the load: health polls,
metrics reads) over the same time, divided by the requests sent in it (failed ones cost CPU
too) and by the chunks with a choice the clients received. At concurrency 1 the idle rate is a
large part of the gross figure, which is kept as ``gross_cpu_ms_per_request``. The split into
a fixed cost per request plus a cost per chunk needs two runs with different chunk counts:
``fit_cost`` solves ``cpu per request = a + b x chunks per request`` from them. Several runs
of one target at one level (rounds taking turns with another target) are ``Pooled``: their
CPU and counts summed, so a longer round weighs more.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from bench.harness.records import RequestRecord
from bench.harness.summary import Stats, Summary


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """CPU readings around a measured phase."""

    server_s: float | None
    """CPU seconds the server under test used, user + system (None: not measured)."""
    engine_s: float | None
    """CPU seconds the fake engines used."""
    wall_s: float
    core_busy: Mapping[int, float]
    """Share of each core's time that anything (ours or not) was running, 0..1."""
    generator_s: float | None = None
    """CPU seconds of the load generator (this process)."""
    server_system_s: float | None = None
    """The part of ``server_s`` spent in the kernel (socket reads and writes, mostly)."""

    @property
    def others_cores(self) -> float | None:
        """Cores' worth of CPU used by processes that are not part of the benchmark (other
        people's work on a shared machine): what perturbs the figures."""
        if self.wall_s <= 0 or self.generator_s is None:
            return None
        busy_s = sum(self.core_busy.values()) * self.wall_s
        ours_s = (self.server_s or 0.0) + (self.engine_s or 0.0) + self.generator_s
        return max(0.0, busy_s - ours_s) / self.wall_s


@dataclass(frozen=True, slots=True)
class LevelResult:
    """One target at one concurrency."""

    target: str
    concurrency: int
    num_tokens: int
    """``max_tokens`` of every request."""
    summary: Summary
    num_chunks: int
    """Chunks with a choice the clients received in the measured phase."""
    cpu: CpuWindow
    idle_cpu_ms_per_s: float | None = None
    """The server's CPU when no request runs (health polls, metrics reads), ms per second."""
    num_warmup: int = 0
    warmup_wall_s: float = 0.0
    rss_idle_bytes: int | None = None
    """The server's resident memory when it was up and idle, before any level."""
    rss_peak_bytes: int | None = None
    """Its highest resident memory sampled in this level's measured phase."""

    @property
    def kb_per_stream(self) -> float | None:
        """Memory per open stream: (peak - idle) / concurrency, in KiB (an upper bound)."""
        if self.rss_idle_bytes is None or self.rss_peak_bytes is None:
            return None
        return max(self.rss_peak_bytes - self.rss_idle_bytes, 0) / self.concurrency / 1024

    def kb_per_added_stream(self, lower: LevelResult) -> float | None:
        """Memory per stream added over ``lower``, the same server's smaller level run just
        before this one: (this peak - its peak) / the streams added, in KiB. What the warm-up grew
        once (caches, pools, the allocator's first arenas) is in both peaks, so this is
        what one more open stream costs; None when either peak is missing."""
        if self.rss_peak_bytes is None or lower.rss_peak_bytes is None:
            return None
        if lower.concurrency >= self.concurrency:
            raise ValueError("the lower level must have fewer streams")
        grown = max(self.rss_peak_bytes - lower.rss_peak_bytes, 0)
        return grown / (self.concurrency - lower.concurrency) / 1024

    @property
    def load_cpu_s(self) -> float | None:
        """The server's CPU in the measured phase less its idle rate over the same time."""
        return net_cpu_s(self.cpu.server_s, self.idle_cpu_ms_per_s, self.cpu.wall_s)

    @property
    def cpu_ms_per_request(self) -> float | None:
        """Net of the idle rate (see ``load_cpu_s``)."""
        return per_unit_ms(self.load_cpu_s, self.summary.sent)

    @property
    def cpu_ms_per_chunk(self) -> float | None:
        """Net of the idle rate (see ``load_cpu_s``)."""
        return per_unit_ms(self.load_cpu_s, self.num_chunks)

    @property
    def gross_cpu_ms_per_request(self) -> float | None:
        return per_unit_ms(self.cpu.server_s, self.summary.sent)

    @property
    def chunks_per_request(self) -> float:
        return self.num_chunks / self.summary.completed if self.summary.completed else 0.0

    @property
    def server_core_share(self) -> float | None:
        """The server's CPU seconds per wall second (1.0 = one core saturated)."""
        if self.cpu.server_s is None or self.cpu.wall_s <= 0:
            return None
        return self.cpu.server_s / self.cpu.wall_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "concurrency": self.concurrency,
            "num_tokens": self.num_tokens,
            "num_chunks": self.num_chunks,
            "chunks_per_request": self.chunks_per_request,
            "cpu_server_s": self.cpu.server_s,
            "cpu_server_system_s": self.cpu.server_system_s,
            "cpu_engine_s": self.cpu.engine_s,
            "wall_s": self.cpu.wall_s,
            "core_busy": {str(core): busy for core, busy in self.cpu.core_busy.items()},
            "cpu_generator_s": self.cpu.generator_s,
            "others_cores": self.cpu.others_cores,
            "idle_cpu_ms_per_s": self.idle_cpu_ms_per_s,
            "num_warmup": self.num_warmup,
            "warmup_wall_s": self.warmup_wall_s,
            "load_cpu_s": self.load_cpu_s,
            "gross_cpu_ms_per_request": self.gross_cpu_ms_per_request,
            "cpu_ms_per_request": self.cpu_ms_per_request,
            "cpu_ms_per_chunk": self.cpu_ms_per_chunk,
            "server_core_share": self.server_core_share,
            "rss_idle_bytes": self.rss_idle_bytes,
            "rss_peak_bytes": self.rss_peak_bytes,
            "kb_per_stream": self.kb_per_stream,
            "summary": self.summary.to_dict(),
        }


@dataclass(frozen=True, slots=True)
class Added:
    """Latency a server adds over direct, per percentile (ms; None when either side is empty)."""

    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None


@dataclass(frozen=True, slots=True)
class Cost:
    """CPU cost split: a fixed part per request and a part per streamed chunk (ms)."""

    ms_per_request: float
    ms_per_chunk: float

    def at(self, chunks_per_request: float) -> float:
        """CPU ms of one request streaming that many chunks."""
        return self.ms_per_request + self.ms_per_chunk * chunks_per_request


ANCHORS = {
    "bare relay (anchor)": Cost(ms_per_request=0.13, ms_per_chunk=0.024),
    "LiteLLM 1.106 (anchor)": Cost(ms_per_request=22.0, ms_per_chunk=0.6),
}
"""Reference costs measured on this kind of 2-core machine with the same pinning: a bare aiohttp
relay (the floor for any Python gateway) and LiteLLM's proxy 1.106."""


def per_unit_ms(cpu_s: float | None, count: int) -> float | None:
    """``cpu_s`` per unit, in milliseconds (None when not measured or nothing counted)."""
    if cpu_s is None or count <= 0:
        return None
    return cpu_s * 1000 / count


def net_cpu_s(cpu_s: float | None, idle_ms_per_s: float | None, wall_s: float) -> float | None:
    """``cpu_s`` less what the server burns idle over ``wall_s`` (never below 0)."""
    if cpu_s is None:
        return None
    if idle_ms_per_s is None:
        return cpu_s
    return max(0.0, cpu_s - idle_ms_per_s / 1000 * wall_s)


def count_chunks(records: Sequence[RequestRecord]) -> int:
    """Chunks with a choice received by the measured (non-warm-up) completed requests."""
    return sum(1 + len(r.itl_s) for r in records if not r.warmup and r.ok and r.ttft_s is not None)


def core_busy(
    before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]]
) -> dict[int, float]:
    """Per core, the busy share between two ``(busy_s, total_s)`` readings."""
    shares: dict[int, float] = {}
    for core, ((busy0, total0), (busy1, total1)) in enumerate(zip(before, after, strict=True)):
        elapsed = total1 - total0
        shares[core] = (busy1 - busy0) / elapsed if elapsed > 0 else 0.0
    return shares


def _diff(through: Stats | None, direct: Stats | None, field: str) -> float | None:
    if through is None or direct is None:
        return None
    return float(getattr(through, field)) - float(getattr(direct, field))


def added_latency(through: Summary, direct: Summary) -> Added:
    """What ``through`` adds to ``direct`` at p50 and p99 of TTFT and ITL (ms)."""
    t, d = through.metrics, direct.metrics
    return Added(
        ttft_p50=_diff(t.get("ttft"), d.get("ttft"), "p50"),
        ttft_p99=_diff(t.get("ttft"), d.get("ttft"), "p99"),
        itl_p50=_diff(t.get("itl"), d.get("itl"), "p50"),
        itl_p99=_diff(t.get("itl"), d.get("itl"), "p99"),
    )


class CpuPerRequest(Protocol):
    """What ``fit_cost`` reads of a run: a ``LevelResult``, or ``Pooled`` ones."""

    @property
    def cpu_ms_per_request(self) -> float | None: ...

    @property
    def chunks_per_request(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Pooled:
    """Runs of one target at one level and length, taken together: CPU and counts summed."""

    runs: tuple[LevelResult, ...]

    @property
    def load_cpu_s(self) -> float | None:
        """Net of each run's idle rate; None when any run has no CPU reading."""
        each = [r.load_cpu_s for r in self.runs]
        return None if not each or None in each else sum(c for c in each if c is not None)

    @property
    def num_requests(self) -> int:
        """Requests sent in the measured phases (failed ones too: they cost CPU)."""
        return sum(r.summary.sent for r in self.runs)

    @property
    def num_failed(self) -> int:
        return sum(r.summary.failed for r in self.runs)

    @property
    def num_chunks(self) -> int:
        return sum(r.num_chunks for r in self.runs)

    @property
    def cpu_ms_per_request(self) -> float | None:
        return per_unit_ms(self.load_cpu_s, self.num_requests)

    @property
    def cpu_ms_per_chunk(self) -> float | None:
        return per_unit_ms(self.load_cpu_s, self.num_chunks)

    @property
    def chunks_per_request(self) -> float:
        completed = sum(r.summary.completed for r in self.runs)
        return self.num_chunks / completed if completed else 0.0


def fit_cost(short: CpuPerRequest, long: CpuPerRequest) -> Cost | None:
    """The per-request and per-chunk CPU from two runs that stream different chunk counts
    (e.g. 1 token and 32 tokens); None without CPU readings or with equal chunk counts."""
    y_short, y_long = short.cpu_ms_per_request, long.cpu_ms_per_request
    c_short, c_long = short.chunks_per_request, long.chunks_per_request
    if y_short is None or y_long is None or abs(c_long - c_short) < 1e-9:
        return None
    per_chunk = (y_long - y_short) / (c_long - c_short)
    return Cost(ms_per_request=y_short - per_chunk * c_short, ms_per_chunk=per_chunk)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def find(results: Sequence[LevelResult], target: str, concurrency: int) -> LevelResult | None:
    """The result of ``target`` at ``concurrency`` (the first, if run more than once)."""
    return next((r for r in results if r.target == target and r.concurrency == concurrency), None)
