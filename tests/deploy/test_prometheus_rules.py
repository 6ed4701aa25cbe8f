"""deploy/: the Prometheus recording rules and alerts, their promtool unit tests, and the Grafana
dashboard, held to what the gateway really exports.

promtool (from Debian's ``prometheus`` package: ``scripts/install --dev``) validates the rule
files and runs their unit tests (``deploy/prometheus/tests/*.yml``); without it these tests
fail, never skip. Every series a rule, an alert or a panel reads must be one the gateway, its
billing collectors or its worker re-export renders, or one the recording rules record; every
label matcher on a gateway series must name one of its labels.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from admission.admitter import AdmissionConfig, Admitter
from billing.cost import CostMeter
from billing.cost_metrics import CostCollector
from billing.metrics import BillingCollector
from billing.service import Billing, BillingConfig
from billing.sql_store import SqliteLedgerStore
from core.messages import Endpoint, ServingPath, Usage
from core.models import ServedModel
from core.request import Request, RequestPhase
from gateway.metrics import GatewayMetrics
from workers.scrape import _EXPORTED as WORKER_REEXPORTS  # what scrape_workers renders

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "tandem.rules.yml"
ALERTS = PROMETHEUS_DIR / "tandem.alerts.yml"
UNIT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Grafana's variables, as a query that promtool can parse would spell them.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$version": ".*", "$tenant": ".*"}
PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
SERVED = ServedModel("llama", 4096, 0, version="llama@0123abcd")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return f"{' '.join(result.args)} exited {result.returncode}:\n{result.stdout}{result.stderr}"


@pytest.fixture(scope="module")
def promtool() -> str:
    executable = shutil.which("promtool")
    if executable is None:
        pytest.fail(
            "promtool is not on PATH: run scripts/install --dev (Debian's prometheus package "
            "provides it); the deploy/ rules are never left unchecked"
        )
    return executable


def _load_yaml(path: Path) -> Any:
    with path.open() as file:
        return yaml.safe_load(file)


def _rules(path: Path) -> list[dict[str, Any]]:
    return [rule for group in _load_yaml(path)["groups"] for rule in group["rules"]]


def _dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in _panels(dashboard) for target in panel.get("targets", [])]


def _variable_queries(dashboard: dict[str, Any]) -> list[str]:
    return [
        variable["definition"]
        for variable in dashboard["templating"]["list"]
        if variable["type"] == "query"
    ]


def _grafana_free(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers left once strings, label
    matchers, ranges, grouping clauses and numbers are gone, except functions and keywords."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'|`[^`]*`", '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\$\{?\w+\}?", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\boffset\s+\w+", " ", expr)
    expr = re.sub(r"(?<![\w:])\d+(?:\.\d*)?(?:[eE][+-]?\d+)?", " ", expr)
    return {
        match.group(1)
        for match in re.finditer(r"([a-zA-Z_:][\w:]*)\s*(\()?", expr)
        if match.group(2) is None and match.group(1).lower() not in PROMQL_WORDS
    }


def label_matchers(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric name, label names its matchers use) for each ``name{...}`` selector."""
    for match in re.finditer(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*\"", match.group(2)))
        yield match.group(1), labels


def test_series_names_reads_past_functions_matchers_and_clauses() -> None:
    expr = (
        'sum by (tandem_version, le) (rate(a_bucket{le="1.0", x=~"$version"}[$__rate_interval]))'
        ' / on (slo) group_left () (1 - b:recorded:ratio{slo="x"}) > 1e3 and c offset 5m'
        " or vector(0.999) unless scalar(days_in_month() - day_of_month()) * d"
    )
    assert series_names(expr) == {"a_bucket", "b:recorded:ratio", "c", "d"}
    assert list(label_matchers(expr)) == [("a_bucket", {"le", "x"}), ("b:recorded:ratio", {"slo"})]


# -- what the gateway exports ---------------------------------------------------------------


def _ended(phase: RequestPhase, error_code: str | None = None) -> Request:
    """A streamed chat request that reached ``phase``, with timings for every histogram."""
    body = {"model": "llama", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    request = Request.receive("r1", Endpoint.CHAT, SERVED, body, tenant_id="acme")
    request.path = ServingPath.COLOCATED
    request.advance(RequestPhase.DECODING)
    request.count_output(3)
    if phase is RequestPhase.FAILED:
        request.fail(error_code)
    else:
        request.finish("stop", Usage(prompt_tokens=5, completion_tokens=3))
    request.started_at, request.first_token_at, request.finished_at = 10.0, 10.2, 10.5
    return request


def _label_names(exposition: bytes) -> dict[str, set[str]]:
    """Series name -> the label names of its samples; a family without samples (nothing
    observed yet) gets its series names from its type, with no labels known."""
    labels: dict[str, set[str]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    for family in text_string_to_metric_families(exposition.decode()):
        for suffix in suffixes.get(family.type, ("",)):
            labels.setdefault(family.name + suffix, set())
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return labels


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Every series name /metrics may show, with the label names seen on it."""
    metrics = GatewayMetrics([])
    metrics.watch_admission(Admitter(AdmissionConfig(4, 4, default_queue_timeout_s=1.0)))
    metrics.observe_end(_ended(RequestPhase.FINISHED), "standard")
    metrics.observe_end(_ended(RequestPhase.FAILED, "engine_error"), "standard")
    series = _label_names(metrics.render())

    state = tmp_path_factory.mktemp("billing")
    store = SqliteLedgerStore(state / "ledger.db")
    try:
        billing = Billing(BillingConfig(state / "ledger.db", state / "spool"), store=store)
        registry = CollectorRegistry()
        registry.register(BillingCollector(billing))
        registry.register(CostCollector(CostMeter([])))
        series.update(_label_names(generate_latest(registry)))
    finally:
        store.close()

    # The workers' vLLM series the gateway re-exports, labelled worker and role
    # (workers/scrape.py); the vllm:* originals never reach the gateway's /metrics.
    series.update({name: {"worker", "role"} for name, _, _ in WORKER_REEXPORTS.values()})
    return series


def _recorded() -> set[str]:
    return {rule["record"] for rule in _rules(RULES)}


def test_the_known_series_come_from_the_gateway(exported: dict[str, set[str]]) -> None:
    """Guards the guard: the names below are what the rules lean on most."""
    assert exported["gen_ai_server_request_duration_seconds_count"] >= {
        "gen_ai_operation_name", "gen_ai_request_model", "tandem_version", "tandem_path",
        "tandem_tenant", "tandem_outcome", "error_type",
    }  # fmt: skip
    assert "le" in exported["gen_ai_server_time_to_first_token_seconds_bucket"]
    for name in (
        "gen_ai_server_time_per_output_token_seconds_bucket", "gen_ai_server_token_usage_sum",
        "tandem_admission_queued", "tandem_worker_healthy", "tandem_kv_handoff_bytes_bucket",
        "tandem_budget_spend", "tandem_budget_limit", "tandem_cost_per_1k_tokens_usd",
        "tandem_worker_kv_cache_usage_ratio", "tandem_admission_rejections_total",
    ):  # fmt: skip
        assert name in exported


# -- the rule files -------------------------------------------------------------------------


def test_promtool_accepts_the_rule_files(promtool: str) -> None:
    result = _run(promtool, "check", "rules", str(RULES), str(ALERTS))
    assert result.returncode == 0, _output(result)


def test_the_promtool_unit_tests_pass(promtool: str) -> None:
    assert UNIT_TESTS, "no promtool unit tests under deploy/prometheus/tests"
    result = _run(promtool, "test", "rules", *map(str, UNIT_TESTS))
    assert result.returncode == 0, _output(result)


def test_every_alert_is_tested_firing_and_quiet() -> None:
    alerts = {rule["alert"] for rule in _rules(ALERTS)}
    firing: set[str] = set()
    quiet: set[str] = set()
    for path in UNIT_TESTS:
        for test in _load_yaml(path)["tests"]:
            for case in test.get("alert_rule_test", []):
                name = case["alertname"]
                # A misspelt name would make an empty expectation pass without testing anything.
                assert name in alerts, f"{path.name}: no alert named {name!r}"
                expected = case.get("exp_alerts") or []
                (firing if expected else quiet).add(name)
                for alert in expected:
                    assert "severity" in alert.get("exp_labels", {}), f"{path.name}: {name}"
                    assert {"summary", "description"} <= set(alert.get("exp_annotations", {}))
    assert sorted(alerts - firing) == [], "alerts no test sees firing"
    assert sorted(alerts - quiet) == [], "alerts no test expects quiet"


def test_every_alert_says_how_bad_and_about_whom() -> None:
    for rule in _rules(ALERTS):
        assert rule["labels"]["severity"] in {"page", "ticket"}, rule["alert"]
        annotations = rule["annotations"]
        assert {"summary", "description"} <= set(annotations), rule["alert"]
        subject = "tenant_id" if "Budget" in rule["alert"] else "tandem_version"
        assert f"$labels.{subject}" in annotations["summary"], rule["alert"]


def test_rules_read_only_exported_or_recorded_series(exported: dict[str, set[str]]) -> None:
    known = set(exported) | _recorded()
    read = {name for rule in _rules(RULES) + _rules(ALERTS) for name in series_names(rule["expr"])}
    assert "gen_ai_server_request_duration_seconds_count" in read  # the parser found names
    assert sorted(read - known) == []


def test_rule_matchers_name_labels_the_gateway_exports(exported: dict[str, set[str]]) -> None:
    for rule in _rules(RULES) + _rules(ALERTS):
        for name, labels in label_matchers(rule["expr"]):
            if exported.get(name):  # a series seen with samples: its labels are known
                assert labels <= exported[name], f"{name} has no label {labels - exported[name]}"


# -- the dashboard --------------------------------------------------------------------------


def test_the_dashboard_reads_through_the_datasource_variable() -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 39
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("version", "tenant"):
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["definition"].startswith("label_values(")

    def datasources(node: Any) -> Iterator[Any]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from [value] if key == "datasource" else datasources(value)
        elif isinstance(node, list):
            for item in node:
                yield from datasources(item)

    assert all(ds == DATASOURCE for ds in datasources(dashboard))
    panels = [panel for panel in _panels(dashboard) if panel["type"] != "row"]
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["datasource"] == DATASOURCE for target in panel["targets"])
    ids = [panel["id"] for panel in _panels(dashboard)]
    assert len(ids) == len(set(ids))
    rows = [panel["title"] for panel in dashboard["panels"] if panel["type"] == "row"]
    assert rows == ["Pools", "Tenants", "Versions"]


def test_the_dashboard_queries_parse(promtool: str, tmp_path: Path) -> None:
    """Each panel query, Grafana's variables filled in, checked by promtool as a rule."""
    exprs = [_grafana_free(expr) for expr in _dashboard_exprs(_dashboard())]
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = _run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, _output(result)


def test_the_dashboard_reads_only_exported_or_recorded_series(
    exported: dict[str, set[str]],
) -> None:
    dashboard = _dashboard()
    read = {name for expr in _dashboard_exprs(dashboard) for name in series_names(expr)}
    for query in _variable_queries(dashboard):
        match = re.fullmatch(r"label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)", query)
        assert match is not None, query
        read.add(match.group(1))
        assert match.group(2) in exported[match.group(1)], query
    assert sorted(read - set(exported) - _recorded()) == []
    for expr in _dashboard_exprs(dashboard):
        for name, labels in label_matchers(expr):
            if exported.get(name):
                assert labels <= exported[name], f"{name} has no label {labels - exported[name]}"
