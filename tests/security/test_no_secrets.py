"""No API key or admin key leaves the gateway by a side door: not in any log record (every
logger in the process at DEBUG), not in ``/metrics`` (either format), not in what it exports
over OTLP (trace and metric payloads searched whole), not in any response's body or headers
(errors included) except the one that issues a key. The same search over a real stack's logs
is ``tests/e2e/test_zy_secrets.py``.

Every source is also checked for what must be in it (a request id, the tenant's id), so an
empty capture cannot pass for a clean one.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from gateway.assembly.app import AccessConfig
from gateway.assembly.stores import StoreConfig
from gateway.auth_throttle import AuthThrottleConfig
from telemetry.otlp_metrics import OtlpMetricsConfig
from telemetry.tracing import TracingConfig
from tests.gateway.conftest import ADMIN_KEY, MODEL, FakeStack, make_fake_stack
from tests.otlp_receiver import OtlpReceiver
from tests.security.leaks import Secret, leaks_in, tenant_keys

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


class _Kept(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self._records = records

    def emit(self, record: logging.LogRecord) -> None:
        self._records.append(record)


@contextmanager
def every_log_record() -> Iterator[list[logging.LogRecord]]:
    """Every record any logger of the process emits meanwhile, each logger at DEBUG (uvicorn's,
    which do not propagate to the root, included)."""
    records: list[logging.LogRecord] = []
    handler = _Kept(records)
    root = logging.getLogger()
    loggers = [root] + [
        logger for logger in logging.root.manager.loggerDict.values()
        if isinstance(logger, logging.Logger)
    ]  # fmt: skip
    saved = [(logger, logger.level, logger.disabled) for logger in loggers]
    catchers = [logger for logger in loggers if logger is root or not logger.propagate]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.disabled = False
    for logger in catchers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in catchers:
            logger.removeHandler(handler)
        for logger, level, disabled in saved:
            logger.setLevel(level)
            logger.disabled = disabled


def _text(record: logging.LogRecord) -> str:
    """A record as a handler would write it: message, arguments, traceback, stack."""
    return logging.Formatter("%(name)s %(levelname)s %(message)s").format(record) + repr(
        record.__dict__
    )


@pytest.fixture
async def receiver(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OtlpReceiver]:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms between span batches
    receiver = await OtlpReceiver().start()
    yield receiver
    await receiver.aclose()


class Exchanges:
    """Every response a client got, body read, tagged with what was asked."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, httpx.Response]] = []

    async def keep(self, response: httpx.Response) -> None:
        await response.aread()
        self.seen.append((f"{response.request.method} {response.request.url.path}", response))


async def _scenario(stack: FakeStack, http: httpx.AsyncClient) -> dict[str, str]:
    """A tenant's every kind of request and every kind of refusal; what must show up where."""
    key = await stack.new_tenant("leaky")
    other = await stack.new_tenant("revoked")
    tenant_id = (await stack.admin.get("/admin/v1/tenants/leaky")).json()["tenant_id"]
    await stack.admin.patch("/admin/v1/tenants/leaky/billing", json={"request_log": True})
    auth = {"Authorization": f"Bearer {key}"}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    answered = await http.post("/v1/chat/completions", json=chat, headers=auth)
    assert answered.status_code == 200, answered.text
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    await http.post("/v1/chat/completions", json=stream, headers=auth)
    idempotent = {**auth, "Idempotency-Key": str(uuid.uuid4())}
    for _ in range(2):  # run, then replayed
        await http.post("/v1/chat/completions", json=chat, headers=idempotent)
    await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers=auth)
    await http.post("/v1/moderations", json={"input": "hello"}, headers=auth)
    await http.get("/v1/models", headers=auth)
    await http.get("/v1/usage", headers=auth)
    await http.get("/v1/usage", params={"format": "csv"}, headers=auth)

    # Refusals: each kind of 4xx, with a real key in the request where it can be.
    await http.post("/v1/chat/completions", content=b"{not json", headers=auth)
    await http.post("/v1/chat/completions", json={**chat, "model": "nope"}, headers=auth)
    await http.post("/v1/chat/completions", json={**chat, "max_tokens": 0}, headers=auth)
    await http.get("/admin/v1/tenants", headers=auth)  # a tenant key on the admin API
    await http.get("/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    await http.get("/v1/models", headers={"Authorization": f"Basic {key}"})
    await http.get("/v1/nowhere", headers=auth)
    [listed] = (await stack.admin.get("/admin/v1/tenants/revoked/keys")).json()["data"]
    await stack.admin.post(f"/admin/v1/keys/{listed['key_id']}/revoke")
    await http.get("/v1/models", headers={"Authorization": f"Bearer {other}"})
    for _ in range(4):  # past the throttle's limit of 3: 401s, then a 429
        await http.get("/v1/models", headers={"Authorization": f"Bearer tdm-{uuid.uuid4().hex}"})
    return {"key": key, "other": other, "tenant_id": tenant_id,
            "request_id": answered.headers["x-request-id"]}  # fmt: skip


async def test_no_key_in_logs_metrics_traces_or_answers(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    access = AccessConfig(
        admin_key=ADMIN_KEY,
        stores=StoreConfig(sqlite_path=tmp_path / "tandem.db"),
        auth_throttle=AuthThrottleConfig(max_failures=3),
    )
    exported = {
        "tracing": TracingConfig(traces_endpoint=receiver.url),
        "otlp_metrics": OtlpMetricsConfig(endpoint=receiver.metrics_url),
    }
    exchanges = Exchanges()
    async with make_fake_stack(access=access, gateway=exported) as stack:
        stack.admin.event_hooks["response"].append(exchanges.keep)
        with every_log_record() as records:
            async with httpx.AsyncClient(
                base_url=stack.base_url, event_hooks={"response": [exchanges.keep]}
            ) as http:
                seen = await _scenario(stack, http)
                metrics = [
                    (await http.get("/metrics")).text,
                    (await http.get("/metrics", headers={"Accept": OPENMETRICS})).text,
                ]
    # The stack has stopped: its span and metric exporters have flushed.
    secrets: list[Secret] = [
        Secret("admin key", ADMIN_KEY),
        *tenant_keys([stack.api_key, seen["key"], seen["other"]]),
    ]

    logs = "\n".join(_text(record) for record in records)
    assert seen["request_id"] in logs and "throttled" in logs, "the logs were captured"
    assert all(seen["tenant_id"] in text for text in metrics), "/metrics has the tenant"
    payloads = b"".join(receiver.payloads)
    assert seen["tenant_id"].encode() in payloads and b"gen_ai.server" in payloads
    statuses = {response.status_code for _, response in exchanges.seen}
    assert {200, 400, 401, 403, 404, 429} <= statuses, statuses

    leaks = leaks_in("the logs", logs, secrets)
    leaks += leaks_in("/metrics", metrics[0], secrets)
    leaks += leaks_in("/metrics (OpenMetrics)", metrics[1], secrets)
    leaks += leaks_in("the OTLP exports", payloads, secrets)
    for asked, response in exchanges.seen:
        if asked.startswith("POST /admin/v1/tenants/") and asked.endswith("/keys"):
            continue  # issuing a key: its one and only showing
        answer = f"{response.status_code} {response.headers} {response.text}"
        leaks += leaks_in(f"the answer to {asked} ({response.status_code})", answer, secrets)
    assert not leaks, leaks
