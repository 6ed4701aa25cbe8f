"""The gateway's Prometheus metrics: how requests were served and what the workers look like.

One registry per app (not prometheus_client's global one), so several gateways can live in one
process (tests) without colliding.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from admission.admitter import Admitter
from core.messages import ServingPath
from core.moderation import ModerationDecision
from core.request import Request
from workers.registry import WorkerSource

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# 1 MiB to 4 GiB: one 16-token block of a small model up to long prompts of large ones.
_KV_BYTES_BUCKETS = tuple(float(1 << power) for power in range(20, 33))


class GatewayMetrics:
    """Per-request counters and latencies, plus the workers' live state at scrape time."""

    def __init__(self, pools: Sequence[WorkerSource]) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "tandem_requests",
            "Requests by serving path, why it was chosen, and how they ended.",
            ("path", "reason", "outcome"),
            registry=self.registry,
        )
        self._tokens = Counter(
            "tandem_tokens",
            "Tokens the engines reported, by kind (prompt or completion).",
            ("kind",),
            registry=self.registry,
        )
        self._ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "From request received to the first output reaching the client, by serving path "
            "and priority band.",
            ("path", "band"),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._longest_pause = Histogram(
            "tandem_stream_longest_pause_seconds",
            "Per streamed request, the longest gap between two output chunks, by priority band: "
            "an engine preemption (the request recomputed behind higher-priority work) or a "
            "stall shows here; vLLM counts preemptions per worker, not per request.",
            ("band",),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._e2e = Histogram(
            "tandem_request_duration_seconds",
            "From request received to its end, whatever the outcome.",
            ("path",),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._routes = Counter(
            "tandem_routed_requests",
            "Requests by the workers chosen (prefill is 'none' when it was not split) and path.",
            ("prefill_worker", "decode_worker", "path"),
            registry=self.registry,
        )
        self._prefill_leg = Histogram(
            "tandem_prefill_leg_seconds",
            "Duration of the prefill leg of disaggregated requests (prompt computed, KV kept).",
            ("prefill_worker",),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._decode_first_token = Histogram(
            "tandem_decode_first_token_seconds",
            "From the decode leg sent to its first token: the KV hand-off (transfer and first "
            "step) when disaggregated, the whole prefill when colocated.",
            ("path", "decode_worker"),
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._kv_bytes = Histogram(
            "tandem_kv_handoff_bytes",
            "KV bytes each disaggregated request's transfer handle offered the decode worker "
            "(its blocks times the model's bytes per block).",
            ("prefill_worker", "decode_worker"),
            buckets=_KV_BYTES_BUCKETS,
            registry=self.registry,
        )
        self._rejections = Counter(
            "tandem_admission_rejections",
            "Requests refused at admission, by error code (rate limits, quota, shed, store).",
            ("code",),
            registry=self.registry,
        )
        self._queue_wait = Histogram(
            "tandem_queue_wait_seconds",
            "Time admitted requests waited in the fair queue, by priority band.",
            ("band",),
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self._store_errors = Counter(
            "tandem_quota_store_errors",
            "Quota store operations that failed because the store was unreachable.",
            ("operation",),
            registry=self.registry,
        )
        self._tenant_tokens = Counter(
            "tandem_tenant_tokens",
            "Tokens charged to each tenant after reconciliation.",
            ("tenant",),
            registry=self.registry,
        )
        self._moderation = Counter(
            "tandem_moderation_decisions",
            "Moderation decisions (flags included), by stage, category, provider and action.",
            ("stage", "category", "provider", "action"),
            registry=self.registry,
        )
        self._idempotency = Counter(
            "tandem_idempotency_requests",
            "Requests with an Idempotency-Key, by outcome (run, replayed, in_progress, mismatch).",
            ("outcome",),
            registry=self.registry,
        )
        self.registry.register(_WorkerCollector(pools))

    def watch_admission(self, admitter: Admitter) -> None:
        """Export the admission queue's live length and in-flight count."""
        queued = Gauge(
            "tandem_admission_queued", "Requests waiting in the fair queue.",
            registry=self.registry,
        )  # fmt: skip
        queued.set_function(lambda: admitter.num_queued)
        in_flight = Gauge(
            "tandem_admission_in_flight", "Requests admitted and not yet ended.",
            registry=self.registry,
        )  # fmt: skip
        in_flight.set_function(lambda: admitter.num_in_flight)
        capacity = Gauge(
            "tandem_admission_capacity",
            "Requests the decode pool may run now (healthy workers below the KV watermark).",
            registry=self.registry,
        )
        capacity.set_function(lambda: admitter.capacity)

    def observe_rejection(self, code: str | None) -> None:
        """A request refused before it was admitted."""
        self._rejections.labels(code or "none").inc()

    def observe_moderation(self, decision: ModerationDecision) -> None:
        self._moderation.labels(
            decision.stage.value, decision.category.value, decision.provider,
            decision.action.value,
        ).inc()  # fmt: skip

    def observe_idempotency(self, outcome: str) -> None:
        self._idempotency.labels(outcome).inc()

    def observe_admitted(self, band: str, queue_wait_s: float) -> None:
        self._queue_wait.labels(band).observe(queue_wait_s)

    def observe_store_error(self, operation: str) -> None:
        self._store_errors.labels(operation).inc()

    def observe_charged(self, tenant: str, num_tokens: int) -> None:
        self._tenant_tokens.labels(tenant).inc(num_tokens)

    def observe_end(self, request: Request, band: str) -> None:
        """Record a request that reached a terminal phase (call exactly once per request);
        ``band`` is the priority band it was admitted in."""
        path = str(request.path or "none")
        outcome = request.phase.name.lower()
        self._requests.labels(path, request.path_reason or "none", outcome).inc()
        if request.ttft_s is not None:
            self._ttft.labels(path, band).observe(request.ttft_s)
        if request.stream and request.num_streamed_tokens > 1:
            self._longest_pause.labels(band).observe(request.longest_pause_s)
        if request.e2e_s is not None:
            self._e2e.labels(path).observe(request.e2e_s)
        self._observe_route(request, path)
        if request.usage is not None:
            self._tokens.labels("prompt").inc(request.usage.prompt_tokens)
            self._tokens.labels("completion").inc(request.usage.completion_tokens)

    def _observe_route(self, request: Request, path: str) -> None:
        if request.decode_worker is None:
            return  # ended before any worker was chosen
        prefill = request.prefill_worker or "none"
        self._routes.labels(prefill, request.decode_worker, path).inc()
        if request.prefill_leg_s is not None:
            self._prefill_leg.labels(prefill).observe(request.prefill_leg_s)
        if request.decode_first_token_s is not None:
            self._decode_first_token.labels(path, request.decode_worker).observe(
                request.decode_first_token_s
            )
        if request.kv_bytes is not None and request.path == ServingPath.DISAGGREGATED:
            self._kv_bytes.labels(prefill, request.decode_worker).observe(request.kv_bytes)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)


class _WorkerCollector(Collector):
    def __init__(self, pools: Sequence[WorkerSource]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily(
            "tandem_worker_healthy", "1 if the worker's last health check passed.",
            labels=("worker", "role"),
        )  # fmt: skip
        outstanding = GaugeMetricFamily(
            "tandem_worker_outstanding_requests", "Requests the gateway has in flight on it.",
            labels=("worker", "role"),
        )  # fmt: skip
        for pool in self._pools:
            for worker in pool.workers:
                labels = (worker.name, str(worker.role))
                healthy.add_metric(labels, 1.0 if worker.healthy else 0.0)
                outstanding.add_metric(labels, float(worker.num_outstanding))
        yield healthy
        yield outstanding
