"""Rollout gates' figures from Prometheus: every gateway replica's traffic, not one replica's.

``PrometheusProvider`` implements ``rollouts.provider.MetricsProvider`` with instant queries
(``/api/v1/query``, all evaluated at one instant per call) over the series each replica exposes
on ``/metrics``, summed across replicas and every other label, for one version:

- requests and errors: ``increase(tandem_requests_total[w])`` by ``outcome``. A request is one
  that ended ``finished`` or ``failed``, an error one that ``failed``; ``aborted`` ones (the
  client left) are left out. The gateway counts this series where it fills its own windows, for
  admitted requests only, so the counts are the ones ``WindowsProvider`` reads on one replica.
- latency samples: ``gen_ai_server_time_to_first_token_seconds`` and
  ``gen_ai_server_time_per_output_token_seconds``, ``sum by (le) (increase(..._bucket[w]))``
  (below). These histograms carry no outcome: every request that got a first token counts,
  where the windows keep successes only (a request that fails or is left after its first
  token is rare next to the successes).
- ``output_tokens_mean``: ``tandem_tokens_total{kind="completion"}`` over finished requests;
  finish reasons: ``tandem_finish_reasons_total`` (``none``, a finished request without one,
  left out as the windows leave it out); moderation blocks:
  ``tandem_moderation_blocked_requests_total`` (at most the requests counted).
- cost: ``tandem_cost_per_1k_tokens_usd`` (below).

**Counts are estimates.** ``increase()`` extrapolates the rate between the first and last
samples in its range to the range's edges: right on average for steady traffic, over by up to
about a scrape interval's worth of it when the traffic started or stopped inside the window. It
also misses what a series counted before Prometheus first scraped it (a version's first
requests on a replica, within one scrape interval). Counts come back as floats and are rounded;
ratios (error rate, mean output, the samples' shape) move far less, as numerator and
denominator extrapolate alike.

**Latency samples from histogram buckets.** A bucket's count increase becomes that many samples
spread evenly across the bucket (``lower + (i + 1/2) x width / n``), the linear interpolation
``histogram_quantile`` assumes: the first bucket starts at 0, and the ``+Inf`` bucket's samples
sit at the last finite bound. So a p95 read from them is ``histogram_quantile(0.95)``'s, and the
resolution is the bucket's width: a change that keeps every request in its bucket is invisible,
and a p95 inside a wide bucket moves less than the latency does. With the conventions' TTFT
buckets, one measurement of the default TTFT gate (x1.1, alpha 0.01; 300 samples a side,
lognormal sigma 0.5, 400 seeded trials) fails a 20 % slower candidate in 2 % of trials at an
80 ms median (both p95s inside the 0.1-0.25 s bucket: the ratio never gets past x1.1), 77 % at
300 ms and 49 % at 1.5 s, against 83 % on exact samples (``WindowsProvider``); identical
versions fail in at most 0.25 %. Within one bucket the
order of candidate and baseline values is invented, so the Mann-Whitney test sees those pairs
as a coin flip, which is what ties are to it; without its tie correction the test is a little
conservative. Past ``max_samples`` a figure's bucket counts are scaled down in proportion (the
shape kept; the test's power at that size is not the limit).

**Cost.** Each gateway's gauge is its own cost meter's $/1k: its workers' cost over the tokens
it billed, in the meter's fixed windows (``window="300s"``). A mean of the gauges is wrong (a
gateway that billed 10 tokens would weigh as much as one that billed a million), and so is one
gateway's. The figure is their mean weighted by each gateway's tokens in that window
(``tandem_tokens_total``, prompt and completion, joined on ``job`` and ``instance``): total cost
over total tokens when each gateway prices its own workers, as ``tandem up`` does. Gateways
that price the same (external) workers each count them whole, so the figure is that many times
too high, for the candidate and the baseline alike: a ratio gate holds, an absolute limit does
not. The window is the longest of the meter's within the gate's window (the phase's own
traffic), else the shortest.

**Shadow copies** are never in these series (they serve no client). ``figures(shadow=True)``
asks the ``shadow`` provider given (the gateway's own ``WindowsProvider``: the lease holder
judges agreement and errors by its replica's copies), or raises ``MetricsUnavailable``.

**Windows** shorter than ``MIN_SCRAPES`` scrape intervals are widened to that: ``increase()``
needs two samples of a series in its range, and over fewer intervals the extrapolation is much
of the answer. Ranges are whole seconds, rounded up.

Any transport error, timeout, non-200 answer or malformed answer raises ``MetricsUnavailable``
naming the query and why: the gates then measure ``error`` and the step holds.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from decimal import Context, Decimal
from typing import Literal

import httpx

from rollouts.gates import VersionFigures
from rollouts.provider import MetricsProvider, MetricsUnavailable

MIN_SCRAPES = 4
"""The shortest window, in scrape intervals (see the module docstring)."""

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DECIMAL = Context(prec=28)
_HISTOGRAMS = {
    "ttft": "gen_ai_server_time_to_first_token_seconds_bucket",
    "itl": "gen_ai_server_time_per_output_token_seconds_bucket",
}
_NO_FINISH_REASON = "none"
"""``tandem_finish_reasons_total``'s value for a finished request the engine gave none."""
_GATEWAY = ("job", "instance")
"""The target labels that tell one gateway's series from another's."""

Row = tuple[dict[str, str], str]
"""One element of an instant vector: its labels and its value as Prometheus wrote it."""


class PrometheusProvider:
    """Figures of every replica, from Prometheus (see the module docstring). ``aclose`` it."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        scrape_interval_s: float = 15.0,
        matchers: Mapping[str, str] | None = None,
        shadow: MetricsProvider | None = None,
        max_samples: int = 100_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``base_url``: Prometheus's, with any path prefix (``http://prometheus:9090``).
        ``timeout_s``: per query. ``scrape_interval_s``: how often Prometheus scrapes the
        gateways (windows are at least ``MIN_SCRAPES`` of them). ``matchers``: label values
        every selector also requires (``{"job": "tandem"}``), so other gateways the same
        Prometheus scrapes are not counted. ``shadow``: where shadow figures come from (None:
        nowhere). ``max_samples``: per figure and version. ``clock``: Unix time queries are
        evaluated at."""
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"the Prometheus URL must start with http:// or https://: {base_url}")
        if not timeout_s > 0 or not scrape_interval_s > 0:
            raise ValueError("timeout_s and scrape_interval_s must be more than 0")
        if max_samples < 1:
            raise ValueError("max_samples must be at least 1")
        for name in matchers or {}:
            if not _LABEL_NAME.match(name):
                raise ValueError(f"{name!r} is not a Prometheus label name")
        self.base_url = base_url.rstrip("/")
        self.min_window_s = MIN_SCRAPES * scrape_interval_s
        self._matchers = dict(matchers or {})
        self._shadow = shadow
        self._max_samples = max_samples
        self._clock = clock
        self._timeout_s = timeout_s
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)

    async def aclose(self) -> None:
        """Close the HTTP client."""
        await self._client.aclose()

    def range_s(self, window_s: float) -> int:
        """The range queries read for a ``window_s`` window: at least ``min_window_s``, whole
        seconds rounded up. ``ValueError`` for a window that is not a positive number."""
        if not (math.isfinite(window_s) and window_s > 0):
            raise ValueError(f"window_s must be a finite number of seconds > 0, not {window_s}")
        return math.ceil(max(window_s, self.min_window_s))

    async def figures(
        self, version: str, window_s: float, *, shadow: bool = False
    ) -> VersionFigures:
        """``version``'s figures over the last ``window_s`` seconds across every replica; shadow
        copies' from the ``shadow`` provider."""
        if shadow:
            if self._shadow is None:
                raise MetricsUnavailable(
                    "shadow comparisons are only measured in-gateway: no provider for them"
                )
            return await self._shadow.figures(version, window_s, shadow=True)
        w, at = self.range_s(window_s), self._clock()
        increase = self._increase
        answers = await self._gather(
            {
                "requests": increase("tandem_requests_total", w, "outcome", version=version),
                "output": increase("tandem_tokens_total", w, kind="completion", version=version),
                "finish": increase(
                    "tandem_finish_reasons_total", w, "finish_reason", version=version
                ),
                "blocks": increase("tandem_moderation_blocked_requests_total", w, version=version),
                "ttft": increase(_HISTOGRAMS["ttft"], w, "le", tandem_version=version),
                "itl": increase(_HISTOGRAMS["itl"], w, "le", tandem_version=version),
                "cost": self._selector("tandem_cost_per_1k_tokens_usd", model_version=version),
            },
            at,
        )
        outcomes = {
            labels.get("outcome", ""): _number(value) for labels, value in answers["requests"]
        }
        finished, failed = round(outcomes.get("finished", 0.0)), round(outcomes.get("failed", 0.0))
        num_requests = finished + failed
        output = sum(_number(value) for _, value in answers["output"])
        finish_reasons = {
            labels.get("finish_reason", ""): round(_number(value))
            for labels, value in answers["finish"]
            if labels.get("finish_reason") != _NO_FINISH_REASON
        }
        blocks = round(sum(_number(value) for _, value in answers["blocks"]))
        busy, provisioned = await self._cost(version, w, answers["cost"], at)
        return VersionFigures(
            num_requests=num_requests,
            num_errors=failed,
            ttft_samples=tuple(self._samples(answers["ttft"])),
            itl_samples=tuple(self._samples(answers["itl"])),
            output_tokens_mean=output / finished if finished > 0 else None,
            finish_reasons={reason: n for reason, n in sorted(finish_reasons.items()) if n > 0},
            # Never more than the requests: the rate gates' test needs events <= trials.
            moderation_blocks=min(blocks, num_requests),
            busy_usd_per_1k=busy,
            provisioned_usd_per_1k=provisioned,
        )

    async def samples(
        self, version: str, window_s: float, figure: Literal["ttft", "itl"]
    ) -> list[float]:
        """The latency samples behind ``figures`` (seconds), rebuilt from histogram buckets."""
        if figure not in _HISTOGRAMS:
            raise ValueError(f"figure must be 'ttft' or 'itl', not {figure!r}")
        query = self._increase(
            _HISTOGRAMS[figure], self.range_s(window_s), "le", tandem_version=version
        )
        rows = (await self._gather({figure: query}, self._clock()))[figure]
        return self._samples(rows)

    def _selector(self, metric: str, **labels: str) -> str:
        # JSON's string syntax is PromQL's (Go's escapes); ensure_ascii=False keeps astral
        # characters whole instead of surrogate pairs, which Go refuses.
        pairs = ",".join(
            f"{name}={json.dumps(value, ensure_ascii=False)}"
            for name, value in {**labels, **self._matchers}.items()
        )
        return f"{metric}{{{pairs}}}"

    def _increase(self, metric: str, range_s: int, by: str = "", **labels: str) -> str:
        """``metric``'s increase over the last ``range_s`` seconds, summed over every replica
        and label but ``by`` (comma-separated)."""
        grouping = f" by ({by})" if by else ""
        return f"sum{grouping} (increase({self._selector(metric, **labels)}[{range_s}s]))"

    def _samples(self, rows: Sequence[Row]) -> list[float]:
        buckets: dict[float, float] = {}
        for labels, value in rows:
            try:
                upper = float(labels["le"])
            except (KeyError, ValueError):
                raise MetricsUnavailable(
                    f"Prometheus answered a histogram bucket without a valid le: {labels}"
                ) from None
            # "1" and "1.0" are one bound, whichever client wrote it: summed, as PromQL did not.
            buckets[upper] = buckets.get(upper, 0.0) + _number(value)
        return samples_from_buckets(buckets, self._max_samples)

    async def _cost(
        self, version: str, range_s: int, rows: Sequence[Row], at: float
    ) -> tuple[Decimal | None, Decimal | None]:
        """(busy, provisioned) $/1k: each gateway's gauge weighted by its tokens (module
        docstring); None for a basis no gateway reported."""
        by_window: dict[float, list[Row]] = defaultdict(list)
        for labels, value in rows:
            window = _window_s(labels.get("window", ""))
            if window is not None:  # else not a cost meter's window: not a series of ours
                by_window[window].append((labels, value))
        if not by_window:
            return None, None
        fitting = [window for window in by_window if window <= range_s]
        window = max(fitting) if fitting else min(by_window)
        tokens_query = self._increase(
            "tandem_tokens_total", math.ceil(window), ",".join(_GATEWAY), version=version
        )
        tokens = {
            _gateway(labels): _decimal(value)
            for labels, value in (await self._gather({"tokens": tokens_query}, at))["tokens"]
        }
        # One value per gateway and basis; a gateway with the version in two deployments (it
        # should not) counts the dearer, erring towards cost as the telemetry does.
        values: dict[str, dict[tuple[str, str], Decimal]] = defaultdict(dict)
        for labels, value in by_window[window]:
            per_gateway = values[labels.get("basis", "")]
            key = _gateway(labels)
            per_gateway[key] = max(per_gateway.get(key, Decimal(0)), _decimal(value))
        return (
            _weighted(values.get("busy", {}), tokens),
            _weighted(values.get("provisioned", {}), tokens),
        )

    async def _gather(self, queries: Mapping[str, str], at: float) -> dict[str, list[Row]]:
        """Every query at once, at the instant ``at``; the first failure fails them all."""
        failure: BaseException | None = None
        try:
            async with asyncio.TaskGroup() as group:
                tasks = {
                    name: group.create_task(self._query(query, at))
                    for name, query in queries.items()
                }
        except* MetricsUnavailable as failed:
            failure = failed.exceptions[0]
        if failure is not None:
            # Raised here, not in the ``except*`` (which wraps whatever it raises in a group on
            # some 3.11 releases): the first query's error, with the transport's as its cause.
            raise failure from failure.__cause__
        return {name: task.result() for name, task in tasks.items()}

    async def _query(self, query: str, at: float) -> list[Row]:
        where = f"Prometheus at {self.base_url}, query {query!r}"
        try:
            response = await self._client.get(
                "/api/v1/query", params={"query": query, "time": f"{at:.3f}"}
            )
        except httpx.TimeoutException as exc:
            raise MetricsUnavailable(f"{where}: no answer within {self._timeout_s:g} s") from exc
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"{where}: {type(exc).__name__}: {exc}") from exc
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code != 200:
            said = body.get("error") if isinstance(body, dict) else response.text[:200]
            raise MetricsUnavailable(f"{where}: HTTP {response.status_code}: {said}")
        if not isinstance(body, dict):
            raise MetricsUnavailable(f"{where}: the answer is not a JSON object")
        if body.get("status") != "success":
            raise MetricsUnavailable(f"{where}: {body.get('errorType')}: {body.get('error')}")
        return _vector(body.get("data"), where)


def samples_from_buckets(buckets: Mapping[float, float], max_samples: int) -> list[float]:
    """Samples rebuilt from a histogram's cumulative counts by upper bound (``le``, ``+Inf``
    included; counts as ``increase()`` gives them, rounded here), spread evenly across each
    bucket; at most ``max_samples`` of them (module docstring)."""
    lower = 0.0
    total_before = 0
    spans: list[tuple[float, float, int]] = []  # (lower, upper, count)
    for upper in sorted(buckets):
        # Cumulative, so never decreasing: extrapolated floats may disagree in the last digit.
        total = max(round(buckets[upper]), total_before)
        count, total_before = total - total_before, total
        if math.isinf(upper):
            spans.append((lower, lower, count))  # past the last bound: at it
        else:
            spans.append((lower, upper, count))
            lower = upper
    counts = _scaled([count for _, _, count in spans], max_samples)
    samples: list[float] = []
    for (low, high, _), count in zip(spans, counts, strict=True):
        width = high - low
        samples.extend(low + (i + 0.5) * width / count for i in range(count))
    return samples


def _scaled(counts: list[int], limit: int) -> list[int]:
    """``counts`` scaled down in proportion to sum to ``limit`` (largest remainders first);
    unchanged when they do not exceed it."""
    total = sum(counts)
    if total <= limit:
        return counts
    exact = [count * limit / total for count in counts]
    scaled = [math.floor(value) for value in exact]
    by_remainder = sorted(range(len(counts)), key=lambda i: scaled[i] - exact[i])
    for i in by_remainder[: limit - sum(scaled)]:
        scaled[i] += 1
    return scaled


def _weighted(
    values: Mapping[tuple[str, str], Decimal], tokens: Mapping[tuple[str, str], Decimal]
) -> Decimal | None:
    """Gateways' $/1k weighted by their tokens; None without a gateway that served any."""
    weight = sum((tokens.get(key, Decimal(0)) for key in values), Decimal(0))
    if weight <= 0:
        return None
    cost = sum((value * tokens.get(key, Decimal(0)) for key, value in values.items()), Decimal(0))
    return _DECIMAL.divide(cost, weight)


def _vector(data: object, where: str) -> list[Row]:
    """An instant vector's rows, or ``MetricsUnavailable`` saying what is malformed."""
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise MetricsUnavailable(f"{where}: malformed answer: not an instant vector")
    result = data.get("result")
    if not isinstance(result, list):
        raise MetricsUnavailable(f"{where}: malformed answer: no result list")
    rows: list[Row] = []
    for item in result:
        labels = item.get("metric") if isinstance(item, dict) else None
        pair = item.get("value") if isinstance(item, dict) else None
        if (
            not isinstance(labels, dict)
            or not isinstance(pair, list)
            or len(pair) != 2
            or not isinstance(pair[1], str)
            or not math.isfinite(_float(pair[1]))
        ):
            raise MetricsUnavailable(f"{where}: malformed answer: element {item!r}")
        rows.append(({str(k): str(v) for k, v in labels.items()}, pair[1]))
    return rows


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _number(value: str) -> float:
    """A count from ``increase()``: never below 0 (``_vector`` checked it is a number)."""
    return max(float(value), 0.0)


def _decimal(value: str) -> Decimal:
    """A value ``_vector`` checked is a finite number (Decimal reads Go's float syntax)."""
    return max(Decimal(value), Decimal(0))


def _gateway(labels: Mapping[str, str]) -> tuple[str, str]:
    job, instance = _GATEWAY
    return labels.get(job, ""), labels.get(instance, "")


def _window_s(label: str) -> float | None:
    """``"300s"`` (the cost meter's ``window`` label) -> 300.0; None for anything else."""
    if not label.endswith("s"):
        return None
    try:
        window = float(label[:-1])
    except ValueError:
        return None
    return window if math.isfinite(window) and window > 0 else None
