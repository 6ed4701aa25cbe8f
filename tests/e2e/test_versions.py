"""Issue 20 on the real stack: a second version of the bundled model, registered and deployed at
runtime (one colocated decode worker), a 50/50 split and a tenant pin, with the official client.

The candidate differs from the boot version only in its generation defaults (temperature 0 and
a system prompt), so it has its own id; its answers to one prompt are identical (temperature 0),
which the baseline's (vLLM's default sampling) are not required to be. At the end the policy is
dropped and the candidate undeployed, so the later tests see the stack as it booted.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.conftest import LiveStack, ledger_rows

pytestmark = pytest.mark.e2e

ALIAS_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CANDIDATE_DEFAULTS = {"temperature": 0.0, "system_prompt": "Answer in one short sentence."}
NUM_SPLIT_REQUESTS = 40


@pytest.fixture(scope="module")
def candidate(live_stack: LiveStack) -> Iterator[str]:
    """The candidate version's name, deployed on one decode worker; undeployed after."""
    with live_stack.admin as admin:
        registered = admin.post(
            "/admin/v1/models",
            json={"source": "bundled", "alias": live_stack.model, "defaults": CANDIDATE_DEFAULTS,
                  "note": "terse", "reason": "e2e candidate"},
            timeout=300,
        )  # fmt: skip
        assert registered.status_code == 201, registered.text
        name = str(registered.json()["name"])
        assert name != live_stack.version and name.startswith(f"{live_stack.model}@")
        deployed = admin.post(
            "/admin/v1/deployments",
            json={"version": name, "decode_workers": 1, "reason": "e2e canary"},
            timeout=600,
        )
        assert deployed.status_code == 201, deployed.text
        assert deployed.json()["healthy"]
    try:
        yield name
    finally:
        # Undeploying drains and stops its worker: /ready is back to the boot version alone.
        with live_stack.admin as admin:
            admin.delete(f"/admin/v1/traffic/{live_stack.model}")
            gone = admin.delete(f"/admin/v1/deployments/{name}", timeout=300)
            assert gone.status_code == 200, gone.text
        ready = httpx.get(f"{live_stack.base_url}/ready", timeout=5).json()
        assert list(ready["versions"]) == [live_stack.version]
        assert not any(w["name"].endswith("-decode-0") and w["name"] != "decode-0"
                       for w in ready["workers"])  # fmt: skip


def _ask(client: openai.OpenAI, model: str) -> tuple[str, str, str]:
    """(body's model, x-tandem-model-version, answer) of one chat request."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=ALIAS_QUESTION, max_tokens=16
    )
    completion = raw.parse()
    return (
        completion.model,
        raw.headers["x-tandem-model-version"],
        completion.choices[0].message.content or "",
    )


def _client(live_stack: LiveStack, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{live_stack.base_url}/v1", api_key=key, max_retries=0, timeout=120
    )


def _requests_by_version(live_stack: LiveStack) -> dict[str, float]:
    text = httpx.get(f"{live_stack.base_url}/metrics", timeout=10).text
    counts: dict[str, float] = collections.defaultdict(float)
    pattern = r'^tandem_requests_total\{[^}]*outcome="finished"[^}]*version="([^"]+)"\}\s+(\S+)$'
    for version, value in re.findall(pattern, text, re.M):
        counts[version] += float(value)
    return counts


def test_a_split_and_a_pin_across_two_versions(live_stack: LiveStack, candidate: str) -> None:
    baseline = live_stack.version
    plain = _client(live_stack, live_stack.new_tenant("versions-plain"))
    pinned = _client(live_stack, live_stack.new_tenant("versions-pinned"))
    with live_stack.admin as admin:
        policy = {
            "split": [{"version": baseline, "weight": 50}, {"version": candidate, "weight": 50}],
            "pins": [{"tenant": "versions-pinned", "version": candidate}],
            "reason": "e2e A/B",
        }
        put = admin.put(f"/admin/v1/traffic/{live_stack.model}", json=policy)
        assert put.status_code == 200, put.text
        # Refused while the policy names it: a deployed version in use is not undeployed.
        busy = admin.delete(f"/admin/v1/deployments/{candidate}")
        assert busy.status_code == 409 and busy.json()["error"]["param"] == "version"
    metrics_before = _requests_by_version(live_stack)

    served = [_ask(plain, live_stack.model) for _ in range(NUM_SPLIT_REQUESTS)]
    for model, header, answer in served:
        assert model == header and model in (baseline, candidate)
        assert answer
    count = collections.Counter(model for model, _, _ in served)
    # 50/50 over 40 requests: each side gets 8 or more with probability 1 - 2e-5.
    assert count[baseline] >= 8 and count[candidate] >= 8, count
    candidate_answers = {answer for model, _, answer in served if model == candidate}
    assert len(candidate_answers) == 1, "temperature 0 from the candidate's defaults"

    pinned_served = [_ask(pinned, live_stack.model) for _ in range(6)]
    assert {model for model, _, _ in pinned_served} == {candidate}
    assert {answer for _, _, answer in pinned_served} == candidate_answers

    # The ledger and /metrics split usage by version, agreeing with what the clients saw.
    rows = ledger_rows(live_stack, "versions-plain")
    assert collections.Counter(row["model_version"] for row in rows) == count
    assert all(row["model"] == live_stack.model for row in rows)
    pinned_rows = ledger_rows(live_stack, "versions-pinned")
    assert {row["model_version"] for row in pinned_rows} == {candidate}
    metrics_after = _requests_by_version(live_stack)
    assert metrics_after[candidate] - metrics_before.get(candidate, 0.0) == count[candidate] + 6
    assert metrics_after[baseline] - metrics_before.get(baseline, 0.0) == count[baseline]

    # /v1/models lists the alias, and the versions with the flag.
    listed = httpx.get(
        f"{live_stack.base_url}/v1/models", params={"include_versions": "true"},
        headers={"Authorization": f"Bearer {live_stack.api_key}"}, timeout=10,
    ).json()["data"]  # fmt: skip
    assert [m["id"] for m in listed if "version_of" not in m] == [live_stack.model]
    assert {m["id"] for m in listed if m.get("version_of") == live_stack.model} == {
        baseline,
        candidate,
    }

    # Every change is in the audit log, with who and why.
    with live_stack.admin as admin:
        entries = admin.get("/admin/v1/audit", params={"alias": live_stack.model}).json()["data"]
    actions = [(entry["action"], entry["subject"], entry["reason"]) for entry in entries]
    assert ("version.register", candidate, "e2e candidate") in actions
    assert ("deployment.create", candidate, "e2e canary") in actions
    assert ("policy.set", live_stack.model, "e2e A/B") in actions
    # Admins, tandem up's configuration, the rollout controller (test_rollouts.py's) and the
    # planner (its paused decisions; test_planner.py's).
    assert all(
        entry["actor"].startswith(("admin-", "config", "rollout", "planner")) for entry in entries
    )


def test_a_version_named_directly(live_stack: LiveStack, candidate: str) -> None:
    client = _client(live_stack, live_stack.api_key)
    completion = client.chat.completions.create(
        model=candidate, messages=ALIAS_QUESTION, max_tokens=8
    )
    assert completion.model == candidate
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model=f"{live_stack.model}@00000000", messages=ALIAS_QUESTION, max_tokens=8
        )
    assert caught.value.code == "model_not_found"
