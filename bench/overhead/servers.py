"""The servers under test, started the way their users start them.

- Tandem: ``python -m gateway.cli up --prefill-url URL --decode-url URL --port P`` (what the
  ``tandem up`` console script runs) over external workers, with the embedded default stores
  (SQLite tenants, in-memory quotas). By default it serves the production path: a tenant key
  (auth on) whose plan has RPM/TPM/concurrency limits far above the load (so the quota
  reservation and reconciliation run but never refuse), and every request split in two legs
  (``TANDEM_DISAGGREGATE_MIN_PROMPT_TOKENS=0``). *Colocated* keeps the prefill pool but routes
  every prompt to the decode worker alone (the decider's ``short_prompt`` path).
  ``TANDEM_MAX_IN_FLIGHT_PER_WORKER`` is raised above the highest concurrency: with one decode
  worker the default (32) would queue requests in the fair queue, which measures admission
  policy, not the gateway's cost.
- LiteLLM: ``litellm --config config.yaml --num_workers 1`` with the fake decode engine as an
  OpenAI-compatible ``hosted_vllm/`` model and a master key (auth on, like Tandem's); nothing
  else changed from its defaults (no database, so no spend logs or key lookups, which a
  production proxy would add). ``LITELLM_LOCAL_MODEL_COST_MAP`` only skips a network fetch at
  start-up.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.overhead.procs import Server, StartError, free_port, start_python_server

ADMIN_KEY = "bench-overhead-admin-key"
LITELLM_MASTER_KEY = "sk-bench-overhead"
_UNLIMITED_ENOUGH = {"tpm": 10**12, "rpm": 10**9, "max_concurrent": 10**6}


@dataclass(frozen=True, slots=True)
class TandemSetup:
    """How the gateway under test is configured."""

    two_legs: bool = True
    """Split every request (prefill leg + decode leg); False: colocated on the decode worker."""
    auth: bool = True
    """A tenant key with quota limits; False: ``TANDEM_AUTH_REQUIRED=false`` (anonymous)."""
    max_in_flight_per_worker: int = 4096
    """Admitted requests per decode worker (keep it above the concurrency)."""

    @property
    def label(self) -> str:
        return "tandem-2leg" if self.two_legs else "tandem-colocated"


def start_tandem(
    setup: TandemSetup,
    prefill_url: str,
    decode_url: str,
    model: str,
    work_dir: Path,
    cores: frozenset[int] | None,
) -> tuple[Server, str | None]:
    """The gateway over the given workers, ready; and the API key to call it with."""
    name = setup.label
    state_dir = work_dir / name
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        "TANDEM_SERVED_MODEL_NAME": model,
        "TANDEM_NUM_PREFILL_WORKERS": "0",
        "TANDEM_NUM_DECODE_WORKERS": "0",
        "TANDEM_STATE_DIR": str(state_dir),
        "TANDEM_LOG_DIR": str(state_dir / "logs"),
        "TANDEM_ADMIN_KEY": ADMIN_KEY,
        "TANDEM_AUTH_REQUIRED": "true" if setup.auth else "false",
        "TANDEM_DISAGGREGATE_MIN_PROMPT_TOKENS": "0" if setup.two_legs else str(10**9),
        "TANDEM_MAX_IN_FLIGHT_PER_WORKER": str(setup.max_in_flight_per_worker),
        "TANDEM_MAX_QUEUE": str(max(1024, setup.max_in_flight_per_worker)),
    }
    argv = [
        sys.executable, "-m", "gateway.cli", "up", "--prefill-url", prefill_url,
        "--decode-url", decode_url, "--port", str(port),
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    server = start_python_server(name, argv, url, "/ready", work_dir, cores, env)
    if not setup.auth:
        return server, None
    try:
        return server, create_tenant_key(url, "bench")
    except (httpx.HTTPError, StartError):
        server.stop()
        raise


def create_tenant_key(url: str, tenant: str) -> str:
    """A tenant with high limits through the admin API, and a fresh key of it."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as admin:
        created = admin.post("/admin/v1/tenants", json={"name": tenant, **_UNLIMITED_ENOUGH})
        if created.status_code != 201:
            raise StartError(f"creating tenant {tenant}: {created.status_code} {created.text}")
        issued = admin.post(f"/admin/v1/tenants/{tenant}/keys", json={})
        if issued.status_code != 201:
            raise StartError(f"issuing a key: {issued.status_code} {issued.text}")
        return str(issued.json()["key"])


def gateway_paths(url: str) -> dict[str, float]:
    """``tandem_requests_total`` by ``path/reason/outcome`` from the gateway's ``/metrics``:
    which serving path the requests really took."""
    counts: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_requests_total":
                labels = sample.labels
                key = f"{labels['path']}/{labels['reason']}/{labels['outcome']}"
                counts[key] = counts.get(key, 0.0) + sample.value
    return counts


def start_litellm(
    binary: Path, decode_url: str, model: str, work_dir: Path, cores: frozenset[int] | None
) -> Server:
    """LiteLLM's proxy, one worker, routing ``model`` to the fake decode engine."""
    config = {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {
                    "model": f"hosted_vllm/{model}",
                    "api_base": f"{decode_url}/v1",
                    "api_key": "none",
                },
            }
        ],
        "general_settings": {"master_key": LITELLM_MASTER_KEY},
    }
    config_path = work_dir / "litellm-config.yaml"
    config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    port = free_port()
    argv = [
        str(binary), "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1",
    ]  # fmt: skip
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    url = f"http://127.0.0.1:{port}"
    # Importing litellm takes a while on a busy 2-core machine.
    return start_python_server(
        "litellm", argv, url, "/health/liveliness", work_dir, cores, env, ready_timeout_s=300
    )
