"""No credential in anything the real stack wrote this session: the admin key and every tenant
key issued (``LiveStack.issued_keys``) are searched for in every file of the stack's working
directory (each worker's log, ``tandem-up.log``, the state directory's databases and spool), in
the gateway's ``/metrics`` (both formats) and in every OTLP export the session's receiver got
(the gateway's spans and both workers'). The name sorts just before ``test_zz_faults.py``: the
search covers what every other test made the stack do, before the fault tests kill workers.
The same search on fake engines, with every logger at DEBUG: tests/security/test_no_secrets.py.
"""

from __future__ import annotations

import secrets as random
from pathlib import Path

import httpx
import pytest

from admission.tenants import hash_key
from tests.e2e.conftest import ADMIN_KEY, LiveStack, traced_stream
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.security.leaks import Secret, leaks_in, tenant_keys

pytestmark = pytest.mark.e2e

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


def _traced(spans: list[ReceivedSpan], trace_id: str) -> bool:
    mine = {span.service for span in spans if span.trace_id == trace_id}
    return mine >= {"tandem-gateway", "tandem-vllm"}


def _refusals(live_stack: LiveStack) -> list[httpx.Response]:
    """A few errors with a real key in the request (one failed authentication only: the
    stack's throttle counts this host's failures for the rest of the session)."""
    auth = {"Authorization": f"Bearer {live_stack.api_key}"}
    with httpx.Client(base_url=live_stack.base_url, timeout=30) as http:
        return [
            http.post("/v1/chat/completions", content=b"{not json", headers=auth),
            http.get("/admin/v1/tenants", headers=auth),
            http.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"}),
        ]


def test_no_key_in_the_stacks_logs_state_metrics_or_traces(
    live_stack: LiveStack, otlp_receiver: OtlpReceiver
) -> None:
    assert live_stack.log_dir is not None
    workdir = live_stack.log_dir.parent
    assert live_stack.api_key in live_stack.issued_keys
    secrets = [Secret("admin key", ADMIN_KEY), *tenant_keys(live_stack.issued_keys)]

    trace_id = random.token_hex(16)
    traced_stream(live_stack, trace_id, random.token_hex(8))
    otlp_receiver.wait_for_sync(lambda spans: _traced(spans, trace_id))
    refusals = _refusals(live_stack)
    assert [r.status_code for r in refusals] == [400, 403, 401], [r.text for r in refusals]
    with live_stack.admin as admin:
        tenant_id = admin.get("/admin/v1/tenants/e2e").json()["tenant_id"]
    metrics = [
        httpx.get(f"{live_stack.base_url}/metrics", timeout=30).text,
        httpx.get(
            f"{live_stack.base_url}/metrics", headers={"Accept": OPENMETRICS}, timeout=30
        ).text,
    ]
    payloads = b"".join(list(otlp_receiver.payloads))

    files = sorted(path for path in workdir.rglob("*") if path.is_file())
    names = {str(path.relative_to(workdir)) for path in files}
    # What the search must have read: both workers' logs, tandem up's, the tenant registry
    # (holding the keys' hashes), the metrics and spans of the tenant's requests.
    assert {"tandem-up.log", "logs/prefill-0.log", "logs/decode-0.log"} <= names, names
    assert b"Tandem is up" in (workdir / "tandem-up.log").read_bytes()
    registry = b"".join(_read(path) for path in files if path.name.startswith("tandem.db"))
    assert hash_key(live_stack.api_key).encode() in registry
    assert all(tenant_id in text for text in metrics)
    assert all(service in payloads for service in (b"tandem-gateway", b"tandem-vllm"))
    assert tenant_id.encode() in payloads

    leaks: list[str] = []
    for path in files:
        leaks += leaks_in(str(path.relative_to(workdir)), _read(path), secrets)
    leaks += leaks_in("/metrics", metrics[0], secrets)
    leaks += leaks_in("/metrics (OpenMetrics)", metrics[1], secrets)
    leaks += leaks_in("the OTLP exports", payloads, secrets)
    for response in refusals:
        answer = f"{response.headers} {response.text}"
        leaks += leaks_in(f"the {response.status_code} answer", answer, secrets)
    assert not leaks, leaks


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:  # a segment or WAL gone between the listing and the read
        return b""
