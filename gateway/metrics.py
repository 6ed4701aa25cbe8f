"""The gateway's Prometheus metrics: how requests were served and what the workers look like.

One registry per app (not prometheus_client's global one), so several gateways can live in one
process (tests) without colliding.

Two families of request metrics live side by side: Tandem's own ``tandem_*`` series (dashboards
and tests read them; their names and labels do not change) and the OpenTelemetry GenAI server
instruments (``gen_ai_server_*``) as OTel's Prometheus naming spells them, with the conventions'
bucket advice, so off-the-shelf GenAI dashboards work on Tandem too. Their latency observations
carry the request's W3C trace id as an exemplar when the caller knows it.

Exemplars exist only in the OpenMetrics text format: ``expose`` answers it when the scrape's
``Accept`` asks for it, else the classic text format. Text appended after the registry's own
(the workers' re-exported counters, ``workers/scrape.py``) is parsed into metric families for
OpenMetrics, whose document must name counters and end (``# EOF``) its own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, cast

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from admission.admitter import Admitter
from core.messages import ServingPath
from core.moderation import Action, ModerationDecision
from core.request import Request, RequestPhase
from telemetry.otlp_metrics import (
    DURATION_BUCKETS_S,
    OTHER_ERROR,
    TOKEN_BUCKETS,
    TPOT_BUCKETS_S,
    TTFT_BUCKETS_S,
    OtlpGenAiMetrics,
)
from telemetry.request_trace import operation_name
from workers.registry import WorkerSource

_M = TypeVar("_M", Counter, Histogram)

_LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# 1 MiB to 4 GiB: one 16-token block of a small model up to long prompts of large ones.
_KV_BYTES_BUCKETS = tuple(float(1 << power) for power in range(20, 33))

_GENAI_LABELS = (
    "gen_ai_operation_name", "gen_ai_request_model", "tandem_version", "tandem_path",
    "tandem_tenant",
)  # fmt: skip
# gateway.auth.ANONYMOUS's id (auth off); the layers contract keeps this module from importing it.
_ANONYMOUS_TENANT = "anonymous"

OPENMETRICS_CONTENT_TYPE: str = openmetrics.CONTENT_TYPE_LATEST
"""``application/openmetrics-text; version=1.0.0; charset=utf-8``."""


class GatewayMetrics:
    """Per-request counters and latencies, plus the workers' live state at scrape time.

    ``max_tenant_labels`` bounds the ``tandem_tenant`` label of the GenAI series: the first
    that many tenants seen get their own value, later ones share ``other`` (a label value per
    tenant would make the series count grow with the customer list).
    """

    def __init__(self, pools: Sequence[WorkerSource], max_tenant_labels: int = 100) -> None:
        self.registry = CollectorRegistry()
        self._tenants = _TenantLabels(max_tenant_labels)
        self._otlp: OtlpGenAiMetrics | None = None
        self._children: dict[tuple[Counter | Histogram, tuple[str, ...]], Any] = {}
        self._requests = Counter(
            "tandem_requests",
            "Requests by serving path, why it was chosen, how they ended, and the alias and "
            "version that served them.",
            ("path", "reason", "outcome", "model", "version"),
            registry=self.registry,
        )
        self._tokens = Counter(
            "tandem_tokens",
            "Tokens the engines reported, by kind (prompt or completion), alias and version.",
            ("kind", "model", "version"),
            registry=self.registry,
        )
        self._ttft = Histogram(
            "tandem_time_to_first_token_seconds",
            "From request received to the first output reaching the client, by serving path "
            "and priority band, per version.",
            ("path", "band", "version"),
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
            "From request received to its end, whatever the outcome, per version.",
            ("path", "version"),
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
        self._finish_reasons = Counter(
            "tandem_finish_reasons",
            "Finished requests by the engine's finish reason ('none' when it gave none), alias "
            "and version (the rollout gates' finish-reason drift).",
            ("model", "version", "finish_reason"),
            registry=self.registry,
        )
        self._moderation_blocked = Counter(
            "tandem_moderation_blocked_requests",
            "Admitted requests a moderation block cut short, by alias and version (the rollout "
            "gates' block rate; input refused before admission is in "
            "tandem_moderation_decisions).",
            ("model", "version"),
            registry=self.registry,
        )
        self._init_genai()
        self._init_planner()
        self.registry.register(_WorkerCollector(pools))

    def _init_genai(self) -> None:
        """The OTel GenAI server instruments (semantic conventions for generative AI metrics),
        named as OTel's Prometheus exporter converts them (dots to underscores, ``_seconds``
        for unit ``s``, none for ``{token}``)."""
        self._genai_ttft = Histogram(
            "gen_ai_server_time_to_first_token",
            "gen_ai.server.time_to_first_token: from request received to its first output token "
            "reaching the client.",
            _GENAI_LABELS,
            unit="seconds",
            buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self._genai_tpot = Histogram(
            "gen_ai_server_time_per_output_token",
            "gen_ai.server.time_per_output_token: a stream's mean time between output tokens "
            "after its first.",
            _GENAI_LABELS,
            unit="seconds",
            buckets=TPOT_BUCKETS_S,
            registry=self.registry,
        )
        self._genai_duration = Histogram(
            "gen_ai_server_request_duration",
            "gen_ai.server.request.duration: from request received to its end, by outcome "
            "(finished, failed, aborted) and error type (empty unless failed).",
            (*_GENAI_LABELS, "tandem_outcome", "error_type"),
            unit="seconds",
            buckets=DURATION_BUCKETS_S,
            registry=self.registry,
        )
        # The conventions define token usage only as the client instrument
        # gen_ai.client.token.usage; the gateway measures the same thing server-side, so it uses
        # that instrument's shape and buckets under the server namespace.
        self._genai_tokens = Histogram(
            "gen_ai_server_token_usage",
            "Tokens per request as the engine counted them, by gen_ai_token_type (input, "
            "output): gen_ai.client.token.usage's shape and buckets, measured by the server.",
            (*_GENAI_LABELS, "gen_ai_token_type"),
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )

    def _init_planner(self) -> None:
        """The autoscaling planner's view of each version's pools (``gateway/planning.py``)."""
        self._planner_desired = Gauge(
            "tandem_planner_desired_replicas",
            "Workers the planner's latest step wants in the pool (asked for, or only reported "
            "in a dry run), by version and pool (prefill, decode).",
            ("version", "pool"),
            registry=self.registry,
        )
        self._planner_current = Gauge(
            "tandem_planner_current_replicas",
            "Workers the pool had at the planner's latest step, serving and starting, by "
            "version and pool.",
            ("version", "pool"),
            registry=self.registry,
        )
        self._planner_decisions = Counter(
            "tandem_planner_decisions",
            "Changes of a pool's size the planner decided (each counted once until the pool "
            "reaches it), by version, pool and direction (up, down).",
            ("version", "pool", "direction"),
            registry=self.registry,
        )
        self._planner_step_errors = Counter(
            "tandem_planner_step_errors",
            "Planner steps of a version that failed: load or pools unreadable, the actuator "
            "refusing, or a bug (the step is skipped; the next one tries again).",
            ("version",),
            registry=self.registry,
        )

        self._planner_drains = Counter(
            "tandem_planner_drains",
            "Workers the local actuator drained and stopped, by version, pool and outcome "
            "(clean: all it ran ended before the drain deadline; deadline: streams were cut or "
            "KV reads still pending at it).",
            ("version", "pool", "outcome"),
            registry=self.registry,
        )

    def observe_planner_drain(self, version: str, pool: str, clean: bool) -> None:
        self._planner_drains.labels(version, pool, "clean" if clean else "deadline").inc()

    def observe_planner_pool(self, version: str, pool: str, current: int, desired: int) -> None:
        """A pool's size and the planner's wish for it at its latest step."""
        self._planner_current.labels(version, pool).set(current)
        self._planner_desired.labels(version, pool).set(desired)

    def observe_planner_decision(self, version: str, pool: str, direction: str) -> None:
        self._planner_decisions.labels(version, pool, direction).inc()

    def observe_planner_step_error(self, version: str) -> None:
        self._planner_step_errors.labels(version).inc()

    def forget_planner_version(self, version: str) -> None:
        """Drop an undeployed version's pool gauges (its counters stay: they only grow)."""
        for gauge in (self._planner_current, self._planner_desired):
            for pool in ("prefill", "decode"):
                with contextlib.suppress(KeyError):  # never stepped: no series
                    gauge.remove(version, pool)

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
        self._child(self._rejections, code or "none").inc()

    def observe_moderation(self, decision: ModerationDecision) -> None:
        self._child(
            self._moderation,
            decision.stage.value, decision.category.value, decision.provider,
            decision.action.value,
        ).inc()  # fmt: skip

    def observe_idempotency(self, outcome: str) -> None:
        self._child(self._idempotency, outcome).inc()

    def observe_admitted(self, band: str, queue_wait_s: float) -> None:
        self._child(self._queue_wait, band).observe(queue_wait_s)

    def observe_store_error(self, operation: str) -> None:
        self._child(self._store_errors, operation).inc()

    def observe_charged(self, tenant: str, num_tokens: int) -> None:
        self._child(self._tenant_tokens, tenant).inc(num_tokens)

    def observe_end(self, request: Request, band: str, *, trace_id: str | None = None) -> None:
        """Record a request that reached a terminal phase (call exactly once per request);
        ``band`` is the priority band it was admitted in. ``trace_id`` (the W3C trace id, 32
        lowercase hex) becomes the exemplar of its GenAI latency observations, so a slow bucket
        links to a trace of a request in it."""
        path = str(request.path or "none")
        outcome = request.phase.name.lower()
        alias, version = request.model.name, request.model.version_name
        self._child(
            self._requests, path, request.path_reason or "none", outcome, alias, version
        ).inc()
        if request.ttft_s is not None:
            self._child(self._ttft, path, band, version).observe(request.ttft_s)
        if request.stream and request.num_streamed_tokens > 1:
            self._child(self._longest_pause, band).observe(request.longest_pause_s)
        if request.e2e_s is not None:
            self._child(self._e2e, path, version).observe(request.e2e_s)
        self._observe_route(request, path)
        if request.usage is not None:
            self._child(self._tokens, "prompt", alias, version).inc(request.usage.prompt_tokens)
            self._child(self._tokens, "completion", alias, version).inc(
                request.usage.completion_tokens
            )
        if request.phase is RequestPhase.FINISHED:
            self._child(self._finish_reasons, alias, version, request.finish_reason or "none").inc()
        if request.moderation_action == Action.BLOCK.value:
            self._child(self._moderation_blocked, alias, version).inc()
        self._observe_genai(request, path, trace_id)

    def export_over_otlp(self, otlp: OtlpGenAiMetrics) -> None:
        """Record the GenAI instruments over OTLP as well (telemetry/otlp_metrics.py)."""
        self._otlp = otlp

    def _observe_genai(self, request: Request, path: str, trace_id: str | None) -> None:
        tenant = self._tenants.label(request.tenant_id)
        if self._otlp is not None:
            self._otlp.observe(request, path, tenant)
        labels = (
            operation_name(request.endpoint), request.model.name, request.model.version_name,
            path, tenant,
        )  # fmt: skip
        exemplar = {"trace_id": trace_id} if trace_id is not None else None
        if request.ttft_s is not None:
            self._child(self._genai_ttft, *labels).observe(request.ttft_s, exemplar)
        if request.itl_s is not None:
            self._child(self._genai_tpot, *labels).observe(request.itl_s, exemplar)
        if request.e2e_s is not None:
            failed = request.phase is RequestPhase.FAILED
            error_type = (request.error_code or OTHER_ERROR) if failed else ""
            self._child(
                self._genai_duration, *labels, request.phase.name.lower(), error_type
            ).observe(request.e2e_s, exemplar)
        if request.usage is not None:
            self._child(self._genai_tokens, *labels, "input").observe(request.usage.prompt_tokens)
            self._child(self._genai_tokens, *labels, "output").observe(
                request.usage.completion_tokens
            )

    def _observe_route(self, request: Request, path: str) -> None:
        if request.decode_worker is None:
            return  # ended before any worker was chosen
        prefill = request.prefill_worker or "none"
        self._child(self._routes, prefill, request.decode_worker, path).inc()
        if request.prefill_leg_s is not None:
            self._child(self._prefill_leg, prefill).observe(request.prefill_leg_s)
        if request.decode_first_token_s is not None:
            self._child(self._decode_first_token, path, request.decode_worker).observe(
                request.decode_first_token_s
            )
        if request.kv_bytes is not None and request.path == ServingPath.DISAGGREGATED:
            self._child(self._kv_bytes, prefill, request.decode_worker).observe(request.kv_bytes)

    def _child(self, metric: _M, *values: str) -> _M:
        """``metric.labels(*values)``, looked up once: prometheus_client's ``labels()`` checks
        and locks on every call (1 to 2 us, and a request makes about fifteen). Request series
        are never removed, so a cached child stays the registry's."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return cast(_M, child)

    def render(self) -> bytes:
        """The classic Prometheus text exposition (no exemplars: the format has none)."""
        return generate_latest(self.registry)

    def render_openmetrics(self, appended_text: str = "") -> bytes:
        """The OpenMetrics text exposition, exemplars included; ``appended_text`` (classic
        Prometheus text, e.g. the workers' re-export) is parsed and rendered in the same
        document, before its ``# EOF``."""
        document = _WithAppended(self.registry, appended_text)
        return bytes(openmetrics.generate_latest(document))  # type: ignore[no-untyped-call]

    def expose(self, accept: str | None, appended_text: str = "") -> tuple[bytes, str]:
        """The ``/metrics`` body and its content type for a scrape's ``Accept`` header:
        OpenMetrics when it asks for ``application/openmetrics-text``, else the classic format
        with ``appended_text`` after the registry's own as it is (series, labels and their
        order exactly as its writer spelled them)."""
        if wants_openmetrics(accept):
            return self.render_openmetrics(appended_text), OPENMETRICS_CONTENT_TYPE
        return self.render() + appended_text.encode(), CONTENT_TYPE_LATEST


def wants_openmetrics(accept: str | None) -> bool:
    """Whether an ``Accept`` header lists ``application/openmetrics-text`` with a non-zero
    quality (Prometheus asks for it first, falling back to ``text/plain``). Any version asked
    gets 1.0.0, which every Prometheus that asks for OpenMetrics reads."""
    for media_range in (accept or "").split(","):
        media_type, *params = (part.strip().lower() for part in media_range.split(";"))
        if media_type != "application/openmetrics-text":
            continue
        quality = next((param[2:] for param in params if param.startswith("q=")), "1")
        try:
            if float(quality) > 0:
                return True
        except ValueError:
            continue  # a malformed q: ignore that range, as a server may
    return False


class _TenantLabels:
    """Tenant label values with a bound: the first ``max_labels`` tenants seen keep their id,
    later ones are ``other``; no tenant (or the anonymous one, auth off) is ``none``."""

    def __init__(self, max_labels: int) -> None:
        if max_labels < 0:
            raise ValueError(f"max_tenant_labels must be 0 or more, got {max_labels}")
        self._max_labels = max_labels
        self._labelled: set[str] = set()

    def label(self, tenant_id: str | None) -> str:
        if tenant_id is None or tenant_id == _ANONYMOUS_TENANT:
            return "none"
        if tenant_id in self._labelled:
            return tenant_id
        if len(self._labelled) < self._max_labels:
            self._labelled.add(tenant_id)
            return tenant_id
        return "other"


class _WithAppended(Collector):
    """The registry's families, then those parsed from classic text that lives outside it."""

    def __init__(self, registry: CollectorRegistry, appended_text: str) -> None:
        self._registry = registry
        self._appended_text = appended_text

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
        yield from text_string_to_metric_families(self._appended_text)


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
