"""``/metrics`` for billing: the ledger writer's counters, budgets and alerts.

Read at scrape time from the live objects (a Prometheus ``Collector``), so nothing on the
request path updates a metric twice. Money is shown in currency units as floats: display only.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from billing.records import MICROS_PER_UNIT
from billing.service import Billing


class BillingCollector(Collector):
    """Renders one ``Billing``'s state."""

    def __init__(self, billing: Billing) -> None:
        self._billing = billing

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._billing.writer.stats
        records = CounterMetricFamily(
            "tandem_ledger_records", "Usage records by what happened to them.", labels=("outcome",)
        )
        records.add_metric(("submitted",), stats.num_submitted)
        records.add_metric(("written",), stats.num_written)
        records.add_metric(("duplicate",), stats.num_duplicates)
        records.add_metric(("replayed",), stats.num_replayed)
        records.add_metric(("corrupt_spool_line",), stats.num_corrupt_lines)
        yield records
        yield CounterMetricFamily(
            "tandem_ledger_write_failures",
            "Batches the ledger database refused or could not take (they stay spooled).",
            value=stats.num_write_failures,
        )
        yield CounterMetricFamily(
            "tandem_ledger_spool_errors",
            "Appends to the local spool that failed (the record lived in memory only).",
            value=stats.num_spool_errors,
        )
        yield GaugeMetricFamily(
            "tandem_ledger_pending_records",
            "Records not yet in the ledger database (in memory or spooled on disk).",
            value=self._billing.writer.num_pending,
        )
        yield GaugeMetricFamily(
            "tandem_ledger_database_up",
            "1 if the last write to the ledger database succeeded.",
            value=1.0 if stats.database_up else 0.0,
        )
        spend = GaugeMetricFamily(
            "tandem_budget_spend", "Spend this month, currency units.", labels=("tenant_id",)
        )
        budget = GaugeMetricFamily(
            "tandem_budget_limit", "Monthly budget, currency units.", labels=("tenant_id",)
        )
        used = GaugeMetricFamily(
            "tandem_budget_used_ratio", "Spend over budget this month.", labels=("tenant_id",)
        )
        for status in self._billing.budget_statuses():
            labels = (status.tenant_id,)
            spend.add_metric(labels, status.spend_micros / MICROS_PER_UNIT)
            if status.budget_micros is not None:
                budget.add_metric(labels, status.budget_micros / MICROS_PER_UNIT)
            if status.used_ratio is not None:
                used.add_metric(labels, status.used_ratio)
        yield spend
        yield budget
        yield used
        alerts = CounterMetricFamily(
            "tandem_budget_alerts",
            "Budget alerts this gateway announced, by tenant and threshold (percent).",
            labels=("tenant_id", "threshold"),
        )
        for (tenant_id, threshold), count in sorted(self._billing.alert_stats.fired.items()):
            alerts.add_metric((tenant_id, str(threshold)), count)
        yield alerts
