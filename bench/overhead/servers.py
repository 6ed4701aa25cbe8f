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
- The bare relay (``relay``): ``python -m bench.overhead.bare_relay --upstream URL`` over the
  fake decode engine (``bench/overhead/bare_relay.py``): uvicorn and aiohttp, each chunk parsed
  and written again, nothing else; the floor Tandem's cost is a multiple of (issue 24).
- Traced Tandem (``tandem-traced``): the two-leg setup exporting every request's spans over
  OTLP/HTTP (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``OTEL_TRACES_SAMPLER_ARG=1.0``, the batch
  processor's defaults). Every other Tandem target gets the ``OTEL_*`` variables the gateway
  reads set empty (unset, for it), so a collector configured in this shell does not turn their
  tracing on.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.overhead.fake_vllm import Timing
from bench.overhead.procs import (
    Server,
    StartError,
    free_port,
    start_fake_engine,
    start_python_server,
)

ADMIN_KEY = "bench-overhead-admin-key"
LITELLM_MASTER_KEY = "sk-bench-overhead"
OUTPUT_MODERATION = {"output": {"providers": ["rules"], "actions": {"pii": "redact", "*": "flag"}}}
"""The ``tandem-moderated`` target's default policy: what a tenant that screens its answers sets."""
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
    traffic_policy: bool = False
    """Serve the model through a sticky 50/50 policy over two registered versions (both on the
    same fake workers): every request pays for its version's resolution."""
    tracing: bool = False
    """Export every request's spans to the traces endpoint ``start_tandem`` is given."""
    output_moderation: bool = False
    """Every tenant's output moderated as it streams (``OUTPUT_MODERATION``: the built-in rules,
    PII redacted, other categories flagged): the hold-back window and a check per window."""
    gateway_workers: int = 1
    """Gateway processes on the one port (``tandem up --gateway-workers``); above 1 they share
    the ``redis-server`` ``tandem up`` starts (its CPU counts: it is a child)."""
    tokenizer_dir: Path | None = None
    """The folder whose ``tokenizer.json`` counts prompts (``TANDEM_TOKENIZER_DIR``); None: 4
    characters a token, as with any external workers the gateway has no tokenizer for."""
    redis_url: str | None = None
    """The shared stores (tenants, quotas, idempotency, fairness) in this Redis
    (``TANDEM_REDIS_URL``) for one process: what the step to several processes costs a request
    before any second process runs. None: one process keeps them in memory and SQLite."""

    @property
    def label(self) -> str:
        if self.gateway_workers > 1:
            return f"tandem-{self.gateway_workers}proc"
        if self.redis_url is not None:
            return "tandem-redis"
        if self.traffic_policy:
            base = "tandem-policy"
        elif self.output_moderation:
            base = "tandem-moderated"
        else:
            base = "tandem-2leg" if self.two_legs else "tandem-colocated"
        if not self.tracing:
            return base
        return "tandem-traced" if base == "tandem-2leg" else f"{base}-traced"


def tandem_env(
    setup: TandemSetup, model: str, state_dir: Path, traces_endpoint: str | None = None
) -> dict[str, str]:
    """The gateway's environment (over this process's own): ``traces_endpoint`` is where a
    traced setup sends its spans, and only a traced setup may have one."""
    if setup.tracing != (traces_endpoint is not None):
        raise ValueError(
            f"{setup.label}: a traced setup needs a traces endpoint and only a traced one takes "
            f"it (got {traces_endpoint!r})"
        )
    return {
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
        **(
            {"TANDEM_MODERATION_DEFAULT_POLICY": json.dumps(OUTPUT_MODERATION)}
            if setup.output_moderation
            else {}
        ),
        **tracing_env(traces_endpoint),
        **({"TANDEM_TOKENIZER_DIR": str(setup.tokenizer_dir)} if setup.tokenizer_dir else {}),
        **({"TANDEM_REDIS_URL": setup.redis_url} if setup.redis_url else {}),
    }


def tracing_env(traces_endpoint: str | None) -> dict[str, str]:
    """The ``OTEL_*`` variables ``telemetry.tracing.TracingConfig.from_env`` reads: every request
    sampled and sent to ``traces_endpoint`` over OTLP/HTTP, or (None) tracing off, whatever
    this shell's environment says (an empty variable is an unset one to it)."""
    return {
        "OTEL_SDK_DISABLED": "",
        "OTEL_TRACES_EXPORTER": "",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": traces_endpoint or "",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf" if traces_endpoint else "",
        "OTEL_TRACES_SAMPLER": "",
        "OTEL_TRACES_SAMPLER_ARG": "1.0" if traces_endpoint else "",
    }


def start_tandem(
    setup: TandemSetup,
    prefill_url: str,
    decode_url: str,
    model: str,
    work_dir: Path,
    cores: frozenset[int] | None,
    traces_endpoint: str | None = None,
    more_decode_urls: Sequence[str] = (),
    entry: str = "gateway.cli",
    extra_env: Mapping[str, str] | None = None,
) -> tuple[Server, str | None]:
    """The gateway over the given workers (``more_decode_urls``: decode workers beside
    ``decode_url``), ready; and the API key to call it with. A traced setup sends its spans to
    ``traces_endpoint``. ``entry`` is the module run as ``python -m <entry> up ...`` (another
    one wraps ``tandem up``, as ``bench.overhead.ttft_marks`` does), with ``extra_env`` over
    the gateway's environment."""
    name = setup.label
    state_dir = work_dir / name
    state_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**tandem_env(setup, model, state_dir, traces_endpoint), **(extra_env or {})}
    argv = [
        sys.executable, "-m", entry, "up", "--prefill-url", prefill_url,
        "--decode-url", decode_url, "--port", str(port),
        "--gateway-workers", str(setup.gateway_workers),
    ]  # fmt: skip
    for url in more_decode_urls:
        argv += ["--decode-url", url]
    url = f"http://127.0.0.1:{port}"
    server = start_python_server(name, argv, url, "/ready", work_dir, cores, env)
    try:
        if setup.gateway_workers > 1:
            _wait_for_processes(state_dir / "gateway-processes.json", server)
        if setup.traffic_policy:
            install_policy(
                url, prefill_url if setup.two_legs else None, decode_url, model, state_dir
            )
        return server, create_tenant_key(url, "bench") if setup.auth else None
    except (httpx.HTTPError, StartError):
        server.stop()
        raise


@contextmanager
def wrapped_tandem_over_fake(
    work_dir: Path, timing: Timing, model: str, entry: str, extra_env: Mapping[str, str]
) -> Iterator[tuple[Server, str]]:
    """The fake engine, and ``tandem up`` over it (colocated, auth on) run by ``entry``, a
    module that wraps it for a measurement (``ttft_marks``, ``memory_entry``); the gateway's
    API key. Both stop when the block ends (the gateway first: a wrapper may write its
    findings as it exits)."""
    engine = start_fake_engine("fake", timing, model, work_dir, None)
    try:
        gateway, key = start_tandem(
            TandemSetup(two_legs=False), engine.url, engine.url, model, work_dir, None,
            entry=entry, extra_env=extra_env,
        )  # fmt: skip
        try:
            assert key is not None  # the setup has auth on
            yield gateway, key
        finally:
            gateway.stop()
    finally:
        engine.stop()


def _wait_for_processes(listing: Path, server: Server, timeout_s: float = 120.0) -> None:
    """Until ``tandem up`` lists every gateway process as started (it answers ``/ready``
    before the others have booted: their boot must not count as idle CPU or load)."""
    deadline = time.monotonic() + timeout_s
    while not listing.exists():
        if time.monotonic() > deadline:
            raise StartError(f"{server.name}: its gateway processes did not start")
        time.sleep(0.1)


def install_policy(
    url: str, prefill_url: str | None, decode_url: str, model: str, work_dir: Path
) -> list[str]:
    """Two versions of ``model`` registered from tiny model folders (they differ in their
    weights' bytes), each deployed on the given workers, and a sticky 50/50 policy over them;
    the versions' names."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    names = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as admin:
        for i in range(2):
            folder = _tiny_model_folder(work_dir / f"version-{i}", weights=f"bench {i}".encode())
            registered = admin.post(
                "/admin/v1/models", json={"source": str(folder), "alias": model}
            )
            if registered.status_code not in (200, 201):
                raise StartError(f"registering a version: {registered.text}")
            name = str(registered.json()["name"])
            deploy = {
                "version": name,
                "decode_workers": 0,
                "decode_urls": [decode_url],
                "prefill_urls": [prefill_url] if prefill_url else [],
                "served_as": model,
            }
            deployed = admin.post("/admin/v1/deployments", json=deploy)
            if deployed.status_code != 201:
                raise StartError(f"deploying {name}: {deployed.text}")
            names.append(name)
        policy = {"split": [{"version": n, "weight": 50} for n in names], "sticky": True}
        put = admin.put(f"/admin/v1/traffic/{model}", json=policy)
        if put.status_code != 200:
            raise StartError(f"setting the policy: {put.text}")
    return names


def _tiny_model_folder(path: Path, weights: bytes) -> Path:
    """What fingerprinting reads: a config, a weights file, a tokenizer with a template."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return path


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


def start_relay(decode_url: str, work_dir: Path, cores: frozenset[int] | None) -> Server:
    """The bare SSE relay over the fake decode engine, ready."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.overhead.bare_relay", "--upstream", decode_url,
            "--port", str(port)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    return start_python_server("relay", argv, url, "/health", work_dir, cores, {})


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
