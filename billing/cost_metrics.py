"""The cost meter and the latest telemetry as Prometheus gauges.

Rendered at scrape time from ``CostMeter.snapshot()`` and ``TelemetryCollector.latest``, so
nothing is stored twice. Gauges are floats: fine for dashboards; the exact figures are
``figures_to_json`` (admin API).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from billing.cost import CostMeter
from billing.telemetry import TelemetryCollector

_FIGURE_LABELS = ("deployment", "model_version", "window")


class CostCollector(Collector):
    """``tandem_cost_*``, ``tandem_worker_busy_ratio``, ``tandem_gpu_*`` and ``tandem_host_*``;
    register it on the gateway's ``CollectorRegistry``."""

    def __init__(self, meter: CostMeter, telemetry: TelemetryCollector | None = None) -> None:
        """``telemetry``: None renders the cost figures only."""
        self._meter = meter
        self._telemetry = telemetry

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """Every gauge, as of now."""
        yield from self._cost()
        yield from self._telemetry_gauges()

    def _cost(self) -> Iterator[GaugeMetricFamily]:
        per_1k = GaugeMetricFamily(
            "tandem_cost_per_1k_tokens_usd",
            "USD per 1k tokens served over the window: busy (price x busy time), provisioned "
            "(price x wall time) or charged (what requests paid). Absent without tokens.",
            labels=(*_FIGURE_LABELS, "basis"),
        )
        margin = GaugeMetricFamily(
            "tandem_cost_margin_ratio",
            "(charged - provisioned cost) / charged over the window; absent without charges.",
            labels=_FIGURE_LABELS,
        )
        for f in self._meter.snapshot():
            labels = (f.deployment, f.model_version, f"{f.window_s:g}s")
            for basis, value in (
                ("busy", f.busy_usd_per_1k_tokens),
                ("provisioned", f.provisioned_usd_per_1k_tokens),
                ("charged", f.charged_usd_per_1k_tokens),
            ):
                if value is not None:
                    per_1k.add_metric((*labels, basis), float(value))
            if f.margin_ratio is not None:
                margin.add_metric(labels, float(f.margin_ratio))
        yield per_1k
        yield margin

    def _telemetry_gauges(self) -> Iterator[GaugeMetricFamily]:
        latest = None if self._telemetry is None else self._telemetry.latest
        if latest is None:
            return
        busy = GaugeMetricFamily(
            "tandem_worker_busy_ratio",
            "Busy fraction of the worker over the last telemetry tick, and how it was measured.",
            labels=("worker", "basis"),
        )
        for worker in latest.workers:
            busy.add_metric((worker.worker, str(worker.basis)), worker.ratio)
        yield busy

        util = GaugeMetricFamily(
            "tandem_gpu_utilization_ratio",
            "Fraction of the last NVML sample period during which a kernel ran.",
            labels=("gpu", "uuid"),
        )
        memory = GaugeMetricFamily(
            "tandem_gpu_memory_used_bytes", "GPU device memory in use.", labels=("gpu",)
        )
        power = GaugeMetricFamily("tandem_gpu_power_watts", "GPU power draw.", labels=("gpu",))
        process_memory = GaugeMetricFamily(
            "tandem_gpu_process_memory_bytes",
            "GPU memory of a compute process; worker is empty when the process is no worker's.",
            labels=("gpu", "pid", "worker"),
        )
        for gpu in latest.gpus:
            index = str(gpu.index)
            if gpu.utilization_gpu_pct is not None:
                util.add_metric((index, gpu.uuid), gpu.utilization_gpu_pct / 100)
            memory.add_metric((index,), float(gpu.memory_used_bytes))
            if gpu.power_w is not None:
                power.add_metric((index,), gpu.power_w)
            for process in gpu.processes:
                if process.used_memory_bytes is not None:
                    owner = latest.process_workers.get(process.pid, "")
                    process_memory.add_metric(
                        (index, str(process.pid), owner), float(process.used_memory_bytes)
                    )
        yield util
        yield memory
        yield power
        yield process_memory

        yield GaugeMetricFamily(
            "tandem_host_cpu_utilization_ratio",
            "Host CPU utilization over the last telemetry tick, all CPUs.",
            value=latest.host.cpu_pct / 100,
        )
        yield GaugeMetricFamily(
            "tandem_host_memory_used_bytes",
            "Host memory in use (total minus available).",
            value=float(latest.host.memory_used_bytes),
        )
