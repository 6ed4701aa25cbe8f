"""Issue 21 on the real stack: rollouts of versions of the bundled model, deployed at runtime on
one decode worker each, with short bakes, while clients (the official ``openai`` client) load
the alias.

1. A healthy candidate (greedy-equivalent defaults: ``top_p`` changes nothing at temperature 0)
   is promoted to 100 % with zero failed client requests.
2. The same candidate, deployed at four times a baseline worker's price (so its busy $/1k
   tokens is about twice the baseline's, which runs two workers), fails the cost gate and is
   rolled back.
3. A candidate whose model config is broken (``--hf-overrides '{"rms_norm_eps": 1.0}'``: fluent
   garbage) fails the golden prompts and never gets a client request. (The bundled model in
   bf16 would be the natural case, but with ``--enforce-eager``, as the e2e stack runs, vLLM's
   CPU build answers the golden prompts in bf16 as it does in fp32: measured, 5 of 5 alike.)
4. A candidate deployed with ``--max-num-seqs 1`` (a runtime flag of the deployment: requests
   queue in its engine) fails the TTFT gate and is rolled back with zero failed client
   requests.

Each candidate is undeployed at the end of its test, and the alias's policy dropped: the later
tests see the stack as it booted.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import LiveStack

pytestmark = pytest.mark.e2e

QUICK_QUALITY = {
    # A few of the shipped golden prompts, short answers: the CPU workers are busy with load.
    "prompts": [
        "What is the capital of France?",
        "What is 2 + 2? Answer with a number.",
        "Translate 'hello' into French.",
        "What color is the sky on a clear day?",
        "Name the largest planet in the solar system.",
    ],
    "max_tokens": 16,
}
# A healthy candidate is still slower here by design of the host: its decode worker computes its
# prompts itself and shares core 0 with prefill-0 (``Supervisor._cpu_binds`` gives it the idler
# core of two), where the baseline's decode worker has core 1 alone. Measured on this 2-core
# machine: TTFT p95 0.361 s against the baseline's 0.179 s (x2.0, 26 samples a side); a CI run
# crossed the old x3.0. 20 samples keep the p95 off the single slowest request.
LATENCY_GATE = {"kind": "ttft_p95", "max_ratio": 5.0, "min_samples": 20, "failure_limit": 2}
ERROR_GATE = {"kind": "error_rate", "max_value": 0.0, "min_samples": 10}


class Load:
    """``concurrency`` clients asking the alias until stopped; every failure is kept."""

    def __init__(self, live_stack: LiveStack, concurrency: int = 4) -> None:
        self._client = openai.OpenAI(
            base_url=f"{live_stack.base_url}/v1",
            api_key=live_stack.new_tenant(f"rollout-load-{time.monotonic_ns()}"),
            max_retries=0,
            timeout=120,
        )
        self._model = live_stack.model
        self._concurrency = concurrency
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.served: collections.Counter[str] = collections.Counter()
        self.started: list[tuple[float, str]] = []
        """(wall-clock time the request was sent, the version that served it)."""
        self.failures: list[str] = []

    def __enter__(self) -> Load:
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True)
            for i in range(self._concurrency)
        ]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            sent_at = time.time()
            try:
                raw = self._client.chat.completions.with_raw_response.create(
                    model=self._model,
                    messages=[{"role": "user", "content": f"Say hello to number {i}-{n}."}],
                    max_tokens=12,
                    stream=True,
                )
                version = raw.headers["x-tandem-model-version"]
                for _chunk in raw.parse():
                    pass
                self.served[version] += 1
                self.started.append((sent_at, version))
            except openai.OpenAIError as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")


@contextmanager
def deployed(
    live_stack: LiveStack,
    *,
    defaults: dict[str, Any],
    engine_args: tuple[str, ...] = (),
    deploy_args: tuple[str, ...] = (),
    cost_per_hour: str | None = None,
) -> Iterator[str]:
    """A version of the bundled model, registered and deployed on one decode worker; afterwards
    the alias's policy is dropped and the version undeployed."""
    with live_stack.admin as admin:
        registered = admin.post(
            "/admin/v1/models",
            json={"source": "bundled", "alias": live_stack.model, "defaults": defaults,
                  "engine_args": list(engine_args), "reason": "e2e rollout"},
            timeout=600,
        )  # fmt: skip
        assert registered.status_code in (200, 201), registered.text
        name = str(registered.json()["name"])
        body: dict[str, Any] = {
            "version": name,
            "decode_workers": 1,
            "engine_args": list(deploy_args),
            "reason": "e2e rollout",
        }
        if cost_per_hour is not None:
            body["cost_per_hour"] = cost_per_hour
        deployment = admin.post("/admin/v1/deployments", json=body, timeout=600)
        assert deployment.status_code == 201, deployment.text
    try:
        yield name
    finally:
        with live_stack.admin as admin:
            # A rollout still running (a failed assertion) owns the alias: abort it first.
            active = admin.get("/admin/v1/rollouts", params={"active": "true"}).json()["data"]
            for rollout in active:
                admin.post(f"/admin/v1/rollouts/{rollout['id']}/abort", json={"reason": "cleanup"})
            admin.delete(f"/admin/v1/traffic/{live_stack.model}")
            gone = admin.delete(f"/admin/v1/deployments/{name}", timeout=300)
            assert gone.status_code == 200, gone.text


def start(live_stack: LiveStack, candidate: str, **spec: Any) -> str:
    body = {
        "alias": live_stack.model,
        "baseline": live_stack.version,
        "candidate": candidate,
        "interval_s": 2.0,
        # The default 5 failed rounds in a row span 2.5 minutes at the default 30 s interval,
        # about 10 s at 2 s: CI paused here once on "the quality check failed to run 5 times
        # in a row" (its errors were not kept; ``finished`` now shows them). 15: about 30 s.
        "error_limit": 15,
        "grace_s": 1.0,
        "drain_baseline": False,
        "quality": QUICK_QUALITY,
        "reason": "e2e",
        **spec,
    }
    with live_stack.admin as admin:
        started = admin.post("/admin/v1/rollouts", json=body)
    assert started.status_code == 201, started.text
    return str(started.json()["id"])


def finished(live_stack: LiveStack, rollout_id: str, timeout_s: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    with live_stack.admin as admin:
        while True:
            shown = admin.get(f"/admin/v1/rollouts/{rollout_id}").json()
            if shown["status"] not in ("running", "paused") and shown["report"]:
                return dict(shown)
            assert shown["status"] != "paused", (shown["paused_reason"], shown["decisions"][-3:])
            assert time.monotonic() < deadline, shown["decisions"][-3:]
            time.sleep(0.5)


def split(live_stack: LiveStack) -> list[dict[str, Any]]:
    with live_stack.admin as admin:
        return list(admin.get(f"/admin/v1/traffic/{live_stack.model}").json()["split"])


def story(done: dict[str, Any]) -> str:
    """The rollout's decisions, one line each, with every gate's verdict sentence: what a failed
    assertion prints (pytest cuts a long ``repr`` of the decisions before the verdict that
    matters)."""
    lines = [f"status {done['status']}"]
    for decision in done["decisions"]:
        lines.append(f"{decision['event']}: {decision['detail']}")
        for m in decision.get("measurements") or ():
            lines.append(f"    {m['gate']['kind']} {m['verdict']}: {m['detail']}")
    return "\n".join(lines)


def failed_gates(done: dict[str, Any]) -> set[str]:
    failed = next(d for d in done["decisions"] if d["event"] == "failed")
    return {m["gate"]["kind"] for m in failed["measurements"] if m["verdict"] == "fail"}


def requests_by_version(live_stack: LiveStack) -> dict[str, float]:
    text = httpx.get(f"{live_stack.base_url}/metrics", timeout=10).text
    counts: dict[str, float] = collections.defaultdict(float)
    pattern = r'^tandem_requests_total\{[^}]*version="([^"]+)"\}\s+(\S+)$'
    for version, value in re.findall(pattern, text, re.M):
        counts[version] += float(value)
    return counts


def test_a_costlier_candidate_is_rolled_back_then_a_healthy_one_promoted(
    live_stack: LiveStack,
) -> None:
    # Four times a baseline worker's TANDEM_WORKER_COST_PER_HOUR (1.0; the baseline has two).
    with deployed(live_stack, defaults={"top_p": 0.95}, cost_per_hour="4.0") as candidate:
        with Load(live_stack) as load:
            costly = start(
                live_stack,
                candidate,
                steps=[{"weight": 50, "bake_s": 120}],
                gates=[{"kind": "busy_cost", "max_ratio": 1.5, "min_samples": 10}, ERROR_GATE],
            )
            done = finished(live_stack, costly)
            assert done["status"] == "failed", story(done)
            assert failed_gates(done) == {"busy_cost"}
            assert split(live_stack) == [{"version": live_stack.version, "weight": 100.0}]
            cost = next(
                m for m in done["decisions"][-2]["measurements"] if m["gate"]["kind"] == "busy_cost"
            )
            assert cost["candidate_value"] > 1.5 * cost["baseline_value"] > 0

            # The same candidate without the cost gate: healthy, promoted under load.
            healthy = start(
                live_stack,
                candidate,
                steps=[{"weight": 50, "bake_s": 12}],
                gates=[LATENCY_GATE, ERROR_GATE],
            )
            done = finished(live_stack, healthy)
        assert done["status"] == "succeeded", (story(done), load.failures[:5])
        events = [d["event"] for d in done["decisions"]]
        assert events[:2] == ["started", "quality_passed"], events
        assert events[-3:] == ["step_passed", "promoted", "succeeded"], events
        # A 12 s bake may end with too few samples on a loaded CPU: extended, never failed.
        assert set(events[2:-3]) <= {"step_extended"}, events
        assert done["quality"]["agreement"] >= 0.8
        assert split(live_stack) == [{"version": candidate, "weight": 100.0}]
        assert load.failures == []
        assert load.served[candidate] > 0 and load.served[live_stack.version] > 0


def test_a_candidate_with_broken_answers_fails_the_golden_prompts_and_never_gets_traffic(
    live_stack: LiveStack,
) -> None:
    """A broken model config (``rms_norm_eps`` 1.0, as a bad conversion could leave it): the
    engine is healthy and fast, its answers are fluent garbage, which only the golden prompts
    see."""
    broken = ("--hf-overrides", '{"rms_norm_eps": 1.0}')
    with deployed(live_stack, defaults={}, engine_args=broken) as candidate:
        before = requests_by_version(live_stack).get(candidate, 0.0)
        with Load(live_stack, concurrency=2) as load:
            rollout = start(live_stack, candidate, steps=[{"weight": 50, "bake_s": 30}])
            done = finished(live_stack, rollout)
        assert done["status"] == "failed", story(done)
        assert [d["event"] for d in done["decisions"]] == ["started", "failed"]
        quality = done["quality"]
        assert quality["outcome"] == "fail" and quality["agreement"] < quality["min_agreement"]
        capital = next(
            p for p in quality["prompts"] if "paris" in (p["baseline_text"] or "").lower()
        )
        assert not capital["agrees"], capital
        assert load.served[candidate] == 0 and load.failures == []
        assert requests_by_version(live_stack).get(candidate, 0.0) == before == 0.0


def test_a_slower_candidate_is_rolled_back_without_a_failed_request(
    live_stack: LiveStack,
) -> None:
    with deployed(
        live_stack, defaults={"top_p": 0.9}, deploy_args=("--max-num-seqs", "1")
    ) as candidate:
        with Load(live_stack, concurrency=8) as load:
            rollout = start(
                live_stack,
                candidate,
                steps=[{"weight": 50, "bake_s": 120}],
                gates=[
                    {"kind": "ttft_p95", "max_ratio": 1.5, "min_samples": 8, "failure_limit": 1},
                    ERROR_GATE,
                ],
                quality={"enabled": False},
            )
            done = finished(live_stack, rollout)
            time.sleep(3)  # requests queued on the candidate finish; no new one is sent there
        assert done["status"] == "failed", story(done)
        assert failed_gates(done) == {"ttft_p95"}
        assert split(live_stack) == [{"version": live_stack.version, "weight": 100.0}]
        assert load.failures == []
        # In-flight requests finish on the candidate; none sent after the rollback goes there
        # (one gateway: the policy is in force within its pass, 1 s is slack).
        rolled_back_at = next(d["at"] for d in done["decisions"] if d["event"] == "rolled_back")
        on_candidate = [at for at, version in load.started if version == candidate]
        assert on_candidate and max(on_candidate) < rolled_back_at + 1.0, (
            rolled_back_at,
            sorted(on_candidate)[-3:],
        )
        assert any(at > rolled_back_at + 1.0 for at, _ in load.started), "the load went on"
