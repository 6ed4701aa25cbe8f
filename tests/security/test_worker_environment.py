"""A managed worker (vLLM, and the model code it runs) gets no gateway secret in its
environment: ``tandem up``'s own settings (the admin key, the ledger's and Redis's URLs with
their passwords, remote moderation keys) stay in the gateway. Checked on a real child process
of the fake engine, whose environment is read from ``/proc``."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from kv_transfer.nixl_progress import DELAY_ENV
from tests.security.leaks import Secret, leaks_in
from tests.workers.test_process import fake_spec, healthy, wait_for
from workers.process import WorkerProcess

GATEWAY_SECRETS = {
    "TANDEM_ADMIN_KEY": "admin-key-of-the-gateway",
    "TANDEM_BILLING_DATABASE_URL": "postgresql://tandem:ledger-password@db/tandem",
    "TANDEM_REDIS_URL": "redis://:redis-password@cache:6379/0",
    "TANDEM_MODERATION_PROVIDERS": '{"guard": {"url": "http://g", "api_key": "guard-key"}}',
}


async def test_a_worker_gets_none_of_the_gateways_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in GATEWAY_SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    spec = fake_spec(tmp_path, "decode-0")
    process = WorkerProcess(spec, tmp_path / "logs")
    await process.start()
    try:
        await wait_for(lambda: healthy(spec.base_url))
        assert process.pid is not None
        env = dict(psutil.Process(process.pid).environ())
    finally:
        await process.aclose(timeout_s=5)
    # What the worker needs still reaches it: its own settings and the rest of the environment.
    assert env[DELAY_ENV] == str(spec.launch.connector.progress_delay_us)
    assert env["PATH"]
    secrets = [Secret(name, value.split("@")[0]) for name, value in GATEWAY_SECRETS.items()]
    leaks = leaks_in("the worker's environment", repr(env), secrets)
    leaks += [f"{name} in the worker's environment" for name in GATEWAY_SECRETS if name in env]
    assert not leaks, leaks
