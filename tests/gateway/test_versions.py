"""Model versions and traffic policies through the gateway (issue 20): weighted and sticky
splits, pins and direct access, shadow copies, refusals, the audit log and per-version figures.

Each version runs on a fake decode engine of its own that refuses any ``model`` but its own
(``tests/gateway/versions_stack.py``), so a request sent to the wrong version fails instead of
passing unnoticed. Real uvicorn, the official ``openai`` client, the admin API and the CLI.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import io
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from admission.tokens import TokenCounter, TokenizerCounter
from core.messages import WorkerRole
from core.models import ServedModel
from gateway.catalog import Catalog
from gateway.cli.main import main
from gateway.serving.flow import VERSION_HEADER
from tests.fakes.fake_engine import FakeEngine
from tests.gateway.conftest import ADMIN_KEY
from tests.gateway.versions_stack import ALIAS, VersionsStack, make_versions_stack
from traffic.resolver import Subject
from versions.store_sqlite import SqliteVersionStore
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

pytestmark = pytest.mark.asyncio

T = TypeVar("T")

QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "which version answers this?"}
]
NUM_SPLIT_REQUESTS = 10_000
"""Through the gateway at ``CONCURRENCY``: about a minute on a 2-core machine."""
CONCURRENCY = 48
ADMIN_ACTOR = "admin-" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:8]
SHADOW_TEXT = (
    "shadow says something else entirely, at some length, to be told apart from the primary; "
    "longer than sixteen five-character tokens"
)


# --- helpers ------------------------------------------------------------------------------


async def _fan_out(n: int, concurrency: int, one: Callable[[int], Awaitable[T]]) -> list[T]:
    """``one(i)`` for i in 0..n-1, ``concurrency`` at a time; the results in order of i."""
    results: dict[int, T] = {}
    indices = iter(range(n))

    async def worker() -> None:
        for i in indices:  # one iterator shared: each index is taken once
            results[i] = await one(i)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [results[i] for i in range(n)]


async def _ask(
    client: openai.AsyncOpenAI,
    model: str = ALIAS,
    content: str = "which version answers this?",
    **options: Any,
) -> tuple[str, str]:
    """One chat request: (the version named by the header, the answer's text); the body's
    ``model`` must name the same version."""
    raw = await client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        **options,
    )
    answer = raw.parse()
    version = raw.headers[VERSION_HEADER]
    assert answer.model == version
    return version, answer.choices[0].message.content or ""


async def _served_by(client: openai.AsyncOpenAI, model: str = ALIAS, **options: Any) -> str:
    version, _ = await _ask(client, model, max_tokens=1, **options)
    return version


def _period() -> dict[str, str]:
    today = datetime.now(UTC).date()
    return {"from": str(today - timedelta(days=1)), "to": str(today + timedelta(days=2))}


async def _ledger_rows(stack: VersionsStack) -> list[dict[str, str]]:
    response = await stack.admin.get(
        "/admin/v1/billing/export", params={**_period(), "kind": "requests", "format": "csv"}
    )
    assert response.status_code == 200, response.text
    return list(csv.DictReader(io.StringIO(response.text)))


async def _requests_by_version(stack: VersionsStack) -> Counter[str]:
    """``tandem_requests_total`` summed per ``version`` label."""
    response = await stack.admin.get("/metrics")
    assert response.status_code == 200
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "tandem_requests_total":
                counts[sample.labels["version"]] += int(sample.value)
    return counts


async def _figures(stack: VersionsStack, version: str) -> dict[str, Any]:
    response = await stack.admin.get(f"/admin/v1/versions/{version}/figures")
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _usage(stack: VersionsStack, tenant: str) -> dict[str, Any]:
    response = await stack.admin.get(f"/admin/v1/tenants/{tenant}/usage")
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _comparisons(stack: VersionsStack, version: str) -> dict[str, Any]:
    response = await stack.admin.get(f"/admin/v1/versions/{version}/shadow")
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _audit(stack: VersionsStack, **params: Any) -> list[dict[str, Any]]:
    response = await stack.admin.get("/admin/v1/audit", params=params)
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


def _error(response: Any) -> dict[str, Any]:
    """The OpenAI-shaped error of an httpx response."""
    body = response.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"]), body
    return dict(body["error"])


async def _tandem(
    capsys: pytest.CaptureFixture[str], stack: VersionsStack, *argv: str
) -> tuple[int, Any]:
    """``tandem <argv> --url ... --admin-key ...`` (the connection flags last: they belong to
    the subcommand); exit code and its standard output as JSON."""
    code = await asyncio.to_thread(main, [*argv, "--url", stack.base_url, "--admin-key", ADMIN_KEY])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return code, json.loads(captured.out)


class PeakEngine(FakeEngine):
    """A fake engine that remembers the most generation requests it held at once."""

    peak = 0

    def _enter(self, priority: int, prompt_tokens: int, record: dict[str, Any]) -> Any:
        seq = super()._enter(priority, prompt_tokens, record)
        self.peak = max(self.peak, self.stats.num_running + self.stats.num_waiting)
        return seq


# --- 1. weighted split ----------------------------------------------------------------------


async def test_a_weighted_split_serves_its_shares_and_every_count_agrees() -> None:
    async with make_versions_stack() as stack:
        baseline = stack.versions[0]
        candidate = await stack.add_version(b"v1")
        await stack.set_split((baseline, 90), (candidate, 10))

        started = time.monotonic()
        served = await _fan_out(NUM_SPLIT_REQUESTS, CONCURRENCY, lambda _: _served_by(stack.client))
        elapsed = time.monotonic() - started
        print(f"{NUM_SPLIT_REQUESTS} requests through the gateway in {elapsed:.1f} s")

        counts = Counter(served)
        assert set(counts) == {baseline.name, candidate.name}
        # 10 % of 10,000 is 1,000 +- 30 (one standard deviation): +-100 is 3.3 of them.
        assert abs(counts[candidate.name] - NUM_SPLIT_REQUESTS // 10) <= NUM_SPLIT_REQUESTS // 100
        # Each engine answers only its own model name: it got exactly its version's requests.
        assert baseline.decode.stats.num_requests == counts[baseline.name]
        assert candidate.decode.stats.num_requests == counts[candidate.name]

        ledger = Counter(row["model_version"] for row in await _ledger_rows(stack))
        assert ledger == counts
        assert await _requests_by_version(stack) == counts
        for version in (baseline, candidate):
            figures = await _figures(stack, version.name)
            assert figures["primary"]["num_requests"] == counts[version.name]
            assert figures["primary"]["num_errors"] == 0
            assert figures["shadow"]["num_requests"] == 0


async def test_the_catalog_draws_a_weighted_split_in_its_proportions(tmp_path: Path) -> None:
    store = SqliteVersionStore(tmp_path / "versions.db")
    await store.start()
    try:
        names = (f"{ALIAS}@0000aaaa", f"{ALIAS}@0000bbbb")
        deployments = Deployments(
            [
                Deployment(
                    ServedModel(ALIAS, None, 0, name),
                    WorkerPool(PoolConfig(WorkerRole.PREFILL, name_prefix=name)),
                    WorkerPool(PoolConfig(WorkerRole.DECODE, name_prefix=name)),
                )
                for name in names
            ]
        )
        split = [{"version": names[0], "weight": 90}, {"version": names[1], "weight": 10}]
        await store.put_policy(ALIAS, {"split": split})
        catalog = Catalog(deployments, store)
        await catalog.refresh()
        subject = Subject("tenant", "key")
        drawn = Counter(catalog.resolve(ALIAS, subject).deployment.version for _ in range(10_000))
        assert set(drawn) == set(names)
        assert abs(drawn[names[1]] - 1000) <= 100
        assert {catalog.resolve(ALIAS, subject).reason for _ in range(10)} == {"weighted"}
    finally:
        await store.aclose()


# --- 2. sticky ------------------------------------------------------------------------------


async def test_sticky_subjects_keep_their_version_and_only_move_to_a_growing_one() -> None:
    async with make_versions_stack() as stack:
        baseline = stack.versions[0]
        candidate = await stack.add_version(b"v1")
        # 700 subjects by the OpenAI `user` field, 300 by the session header.
        subjects = [("user", f"user-{i}") for i in range(700)]
        subjects += [("session", f"session-{i}") for i in range(300)]

        async def round_at(weight: int) -> list[str]:
            await stack.set_split((baseline, 100 - weight), (candidate, weight), sticky=True)

            async def one(i: int) -> str:
                kind, name = subjects[i]
                if kind == "user":
                    return await _served_by(stack.client, user=name)
                return await _served_by(stack.client, extra_headers={"x-tandem-session": name})

            return await _fan_out(len(subjects), CONCURRENCY, one)

        at_10 = await round_at(10)
        assert await round_at(10) == at_10  # every subject again, on the same version
        at_50 = await round_at(50)
        at_90 = await round_at(90)

        def share(assigned: list[str]) -> float:
            return assigned.count(candidate.name) / len(assigned)

        # 1,000 subjects: one standard deviation is 1.6 points at 50 %, 0.9 at 10 and 90.
        assert 0.06 <= share(at_10) <= 0.14
        assert 0.44 <= share(at_50) <= 0.56
        assert 0.86 <= share(at_90) <= 0.94
        for before, after in ((at_10, at_50), (at_50, at_90)):
            moves = Counter((a, b) for a, b in zip(before, after, strict=True) if a != b)
            assert set(moves) == {(baseline.name, candidate.name)}  # never back
        # Both kinds of subject were split (a header nobody reads would put them all on one).
        sessions = at_50[700:]
        assert {baseline.name, candidate.name} <= set(sessions)


# --- 3. pins and direct access --------------------------------------------------------------


async def test_pins_beat_the_split_and_direct_access_can_be_closed() -> None:
    async with make_versions_stack() as stack:
        v0 = stack.versions[0]
        v1 = await stack.add_version(b"v1")
        v2 = await stack.add_version(b"v2")
        key_a = await stack.new_tenant_key("pinned")
        key_b = await stack.issue_key("pinned")
        policy: dict[str, Any] = {
            "split": [{"version": v0.name, "weight": 100}],
            "pins": [
                {"tenant": "pinned", "version": v1.name},  # by name: stored by id
                {"tenant": "pinned", "key": key_a["key_id"], "version": v2.name},
            ],
            "direct_access": False,
        }
        response = await stack.put_policy(policy)
        assert response.status_code == 200, response.text
        assert {pin["tenant"] for pin in response.json()["pins"]} == {key_a["tenant_id"]}

        async with (
            stack.client_for(key_a["key"]) as client_a,
            stack.client_for(key_b["key"]) as client_b,
        ):
            for _ in range(10):
                assert await _served_by(stack.client) == v0.name  # the split
                assert await _served_by(client_b) == v1.name  # the tenant's pin
                assert await _served_by(client_a) == v2.name  # the key's pin beats it

            # Direct access closed: only a tenant pinned to a version may name it.
            for name in (v0.name, v1.name, v2.name):
                with pytest.raises(openai.NotFoundError) as refused:
                    await _served_by(stack.client, name)
                assert _error(refused.value.response)["param"] == "model"
            assert await _served_by(client_b, v1.name) == v1.name
            assert await _served_by(client_a, v1.name) == v1.name  # a tenant pin: every key
            with pytest.raises(openai.NotFoundError):
                await _served_by(client_b, v2.name)  # pinned to key a only

        response = await stack.put_policy({**policy, "direct_access": True})
        assert response.status_code == 200, response.text
        for version in (v0, v1, v2):
            assert await _served_by(stack.client, version.name) == version.name
        assert v2.decode.stats.num_requests == 10 + 1  # refused ones never reached it


# --- 4. shadow ------------------------------------------------------------------------------


async def test_shadow_copies_are_compared_but_never_answered_billed_or_charged() -> None:
    async with make_versions_stack() as stack:
        primary = stack.versions[0]
        shadow = await stack.add_version(b"v1", scripted_output=SHADOW_TEXT, token_delay_s=0.01)
        num_shadowed = 6
        await stack.set_split(
            (primary, 100),
            shadow={"version": shadow.name, "percent": 100, "max_in_flight": num_shadowed + 1},
        )
        tpm = 300
        # Each alone in its band, so their fairness counters are their own charges only.
        shadowed_key = await stack.new_tenant_key("shadowed", tpm=tpm, band="batch")
        control_key = await stack.new_tenant_key("control", tpm=tpm, band="interactive")
        prompts = [f"question number {i} about the weather" for i in range(num_shadowed)]
        shadowed: list[tuple[str, str]] = []
        control: list[tuple[str, str]] = []
        async with (
            stack.client_for(shadowed_key["key"]) as shadowed_client,
            stack.client_for(control_key["key"]) as control_client,
        ):
            for prompt in prompts:
                # The same requests: to the alias (copied), and to the version by name
                # (a direct request is never copied).
                shadowed.append(await _ask(shadowed_client, ALIAS, prompt, max_tokens=16))
                control.append(await _ask(control_client, primary.name, prompt, max_tokens=16))

        # The client gets the primary's answer only.
        assert shadowed == control
        assert {version for version, _ in shadowed} == {primary.name}
        assert all(text and "shadow" not in text for _, text in shadowed)

        async def compared() -> dict[str, Any]:
            return await _comparisons(stack, shadow.name)

        deadline = time.monotonic() + 10
        while (await compared())["num_compared"] < num_shadowed:
            assert time.monotonic() < deadline, "the shadow copies did not all end"
            await asyncio.sleep(0.05)
        comparisons = await compared()
        assert comparisons["num_compared"] == num_shadowed
        assert comparisons["num_same_text"] == 0
        by_text = {entry["primary_text"]: entry for entry in comparisons["data"]}
        assert set(by_text) == {text for _, text in shadowed}
        for entry in by_text.values():
            assert entry["primary_version"] == primary.name
            assert entry["shadow_version"] == shadow.name
            assert entry["shadow_text"] == SHADOW_TEXT[: 16 * 5]  # 5-character tokens, capped
            assert entry["shadow_error"] is None
        assert shadow.decode.stats.num_requests == num_shadowed

        # Not billed: the ledger has the primaries only.
        rows = await _ledger_rows(stack)
        assert len(rows) == 2 * num_shadowed
        assert {row["model_version"] for row in rows} == {primary.name}
        # Not charged: the copies' tokens (16 output each) reach neither the quota nor the
        # fairness counter, which match the tenant whose requests were never copied.
        shadowed_usage = await _usage(stack, "shadowed")
        control_usage = await _usage(stack, "control")
        used = sum(
            int(row["prompt_tokens"]) + int(row["completion_tokens"])
            for row in rows
            if row["tenant_id"] == shadowed_key["tenant_id"]
        )
        assert shadowed_usage["tokens"]["remaining"] >= tpm - used
        assert shadowed_usage["fairness_counter_here"] is not None
        assert shadowed_usage["fairness_counter_here"] == control_usage["fairness_counter_here"]
        figures = await _figures(stack, shadow.name)
        assert figures["primary"]["num_requests"] == 0
        assert figures["shadow"]["num_requests"] == num_shadowed
        assert figures["shadow"]["output_tokens"] == 16 * num_shadowed

        # An idempotent retry is answered from the primary's stored answer.
        headers = {"Idempotency-Key": "shadowed-order-1"}
        first = await stack.client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=QUESTION, max_tokens=16, extra_headers=headers
        )
        # Its copy ends before the retry: had the copy written under the key, the retry would
        # replay the shadow's answer.
        deadline = time.monotonic() + 10
        while (await compared())["num_compared"] < num_shadowed + 1:
            assert time.monotonic() < deadline, "the idempotent request's shadow copy did not end"
            await asyncio.sleep(0.05)
        assert shadow.decode.stats.num_requests == num_shadowed + 1
        replay = await stack.client.chat.completions.with_raw_response.create(
            model=ALIAS, messages=QUESTION, max_tokens=16, extra_headers=headers
        )
        assert replay.headers.get("idempotent-replayed") == "true"
        answer, replayed = first.parse(), replay.parse()
        assert (replayed.id, replayed.model) == (answer.id, primary.name)
        text = replayed.choices[0].message.content
        assert text and text == answer.choices[0].message.content and "shadow" not in text


async def test_a_shadow_that_fails_counts_its_errors_and_the_client_never_sees_them() -> None:
    async with make_versions_stack() as stack:
        primary = stack.versions[0]
        shadow = await stack.add_version(b"v1")
        await stack.set_split((primary, 100), shadow={"version": shadow.name, "percent": 100})
        texts = []
        for status in (400, 500):
            shadow.decode.fail_status, shadow.decode.fail_times = status, 1
            version, text = await _ask(stack.client, max_tokens=4)
            assert version == primary.name
            texts.append(text)
        stream = await stack.client.chat.completions.create(
            model=ALIAS, messages=QUESTION, max_tokens=4, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        texts.append(streamed)

        deadline = time.monotonic() + 10
        while (comparisons := await _comparisons(stack, shadow.name))["num_compared"] < 3:
            assert time.monotonic() < deadline, "the shadow copies did not all end"
            await asyncio.sleep(0.05)
        data = comparisons["data"]
        assert [c["primary_text"] for c in data] == texts
        assert [c["shadow_error"] for c in data] == ["invalid_request_error", "engine_error", None]
        assert [c["shadow_text"] is None for c in data] == [True, True, False]
        assert data[2]["same_text"] is True  # a streamed primary is compared by its text
        figures = await _figures(stack, shadow.name)
        assert figures["shadow"]["num_requests"] == 3
        assert figures["shadow"]["errors"] == {"engine_error": 1, "invalid_request_error": 1}
        assert (await _figures(stack, primary.name))["primary"]["num_errors"] == 0


async def test_shadow_copies_past_the_cap_are_dropped_and_counted() -> None:
    async with make_versions_stack() as stack:
        primary = stack.versions[0]
        # Slow (the primary answers in milliseconds): copies overlap unless the cap drops them.
        shadow = await stack.add_version(b"v1", engine_class=PeakEngine, first_token_delay_s=0.3)
        await stack.set_split(
            (primary, 100), shadow={"version": shadow.name, "percent": 100, "max_in_flight": 1}
        )
        engine = shadow.decode
        assert isinstance(engine, PeakEngine)

        async def sent_once_settled() -> int:
            """Copies sent, once those sent have ended (each was started before its primary
            was answered, so none is still to come)."""
            deadline = time.monotonic() + 10
            while True:
                sent = int((await _comparisons(stack, shadow.name))["num_compared"])
                idle = engine.stats.num_running + engine.stats.num_waiting == 0
                if idle and sent == engine.stats.num_requests:
                    return sent
                assert time.monotonic() < deadline, "the shadow copies did not end"
                await asyncio.sleep(0.05)

        num_requests = 40
        for wave in (1, 2):
            served = await _fan_out(num_requests, 20, lambda _: _served_by(stack.client))
            assert set(served) == {primary.name}
            sent = await sent_once_settled()
            # At least one a wave (the slot comes back when a copy ends); the others dropped,
            # not queued.
            assert wave <= sent < wave * num_requests
        assert primary.decode.stats.num_requests == 2 * num_requests
        assert engine.peak == 1
        figures = await _figures(stack, shadow.name)
        assert figures["shadow"]["num_requests"] == sent
        assert figures["primary"]["num_requests"] == 0
        dropped = 2 * num_requests - sent
        assert figures["shadow_copies"] == {"sent": sent, "dropped": dropped, "in_flight": 0}


# --- 5. refusals ----------------------------------------------------------------------------


async def test_bad_models_policies_sources_and_removals_are_refused_with_the_field(
    tmp_path: Path,
) -> None:
    async with make_versions_stack() as stack:
        v0 = stack.versions[0]
        v1 = await stack.add_version(b"v1")
        for model in ("no-such-model", f"{ALIAS}@deadbeef"):
            with pytest.raises(openai.NotFoundError) as missing:
                await _served_by(stack.client, model)
            error = _error(missing.value.response)
            assert error["param"] == "model" and model in error["message"]

        async def refused(policy: dict[str, Any], status: int, param: str) -> None:
            response = await stack.put_policy(policy)
            assert response.status_code == status, response.text
            assert _error(response)["param"] == param

        split = [{"version": v0.name, "weight": 60}, {"version": v1.name, "weight": 30}]
        await refused({"split": split}, 400, "split")
        unknown = [
            {"version": v0.name, "weight": 50},
            {"version": f"{ALIAS}@0badc0de", "weight": 50},
        ]
        await refused({"split": unknown}, 400, "split[1].version")
        registered = await stack.register(b"v2")
        assert registered.status_code == 201, registered.text
        undeployed = registered.json()["name"]
        pin = {"tenant": "default", "version": undeployed}
        await refused({"split": [{"version": v0.name, "weight": 100}], "pins": [pin]}, 400,
                      "pins[0].version")  # fmt: skip
        assert (await stack.admin.get(f"/admin/v1/traffic/{ALIAS}")).status_code == 404
        # A deployment's flags may change how it runs, not what it outputs: those make a version.
        seeded = await stack.admin.post(
            "/admin/v1/deployments",
            json={"version": undeployed, "decode_workers": 1, "engine_args": ["--seed", "3"]},
        )
        assert seeded.status_code == 400 and _error(seeded)["param"] == "engine_args"
        assert "--seed=3" in _error(seeded)["message"]
        # A worker URL the gateway could not call is refused here, not found unhealthy later.
        schemeless = await stack.admin.post(
            "/admin/v1/deployments",
            json={"version": undeployed, "decode_urls": ["gpu-a:8000"]},
        )
        assert schemeless.status_code == 400, schemeless.text
        assert _error(schemeless)["param"] == "decode_urls.0"
        assert "http(s)://host[:port]" in _error(schemeless)["message"]

        for source, named in (
            (tmp_path / "nowhere", str(tmp_path / "nowhere")),
            (_unreadable_weights(stack), "model.safetensors"),
        ):
            response = await stack.admin.post(
                "/admin/v1/models", json={"source": str(source), "alias": ALIAS}
            )
            assert response.status_code == 400, response.text
            error = _error(response)
            assert error["param"] == "source" and named in error["message"]

        # The same content is one version: again under its alias it is there (200), under
        # another alias a conflict.
        assert (await stack.register(b"v1")).status_code == 200
        conflict = await stack.register(b"v1", alias="other")
        assert conflict.status_code == 409 and _error(conflict)["param"] == "source"

        await stack.set_split((v0, 50), (v1, 50))
        for method, path in (
            ("DELETE", f"/admin/v1/models/{v1.name}"),  # a policy names it
            ("DELETE", f"/admin/v1/deployments/{v1.name}"),  # a policy names it
        ):
            response = await stack.admin.request(method, path)
            assert response.status_code == 409, response.text
            assert _error(response)["param"] == "version"
            assert f"/admin/v1/traffic/{ALIAS}" in response.json()["error"]["message"]
        await stack.set_split((v0, 100))
        response = await stack.admin.delete(f"/admin/v1/models/{v1.name}")  # still deployed
        assert response.status_code == 409, response.text
        assert f"/admin/v1/deployments/{v1.name}" in _error(response)["message"]
        # The refusals changed nothing: v1 is registered and serves requests named to it.
        assert await _served_by(stack.client, v1.name) == v1.name
        shown = await stack.admin.get(f"/admin/v1/models/{v1.name}")
        assert shown.status_code == 200 and shown.json()["deployed"] is True


def _unreadable_weights(stack: VersionsStack) -> Path:
    """A model folder whose weights file cannot be read (a folder in its place)."""
    folder = stack.folder(b"unreadable")
    weights = folder / "model.safetensors"
    weights.unlink()
    weights.mkdir()
    return folder


# --- 6. audit -------------------------------------------------------------------------------


async def test_every_change_is_audited_with_its_actor_states_and_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with make_versions_stack() as stack:
        v0 = stack.versions[0]
        v1 = await stack.add_version(b"v1")  # registered and deployed, reasons given
        between = time.time()
        canary = {"split": [{"version": v0.name, "weight": 95}, {"version": v1.name, "weight": 5}]}
        response = await stack.put_policy({**canary, "reason": "canary"})
        assert response.status_code == 200, response.text
        other = await stack.register(b"o1", alias="other", reason="another model")
        assert other.status_code == 201, other.text

        _, listed = await _tandem(capsys, stack, "model", "list", "--alias", ALIAS)
        assert {v["name"]: v["deployed"] for v in listed["data"]} == {v0.name: True, v1.name: True}
        _, policy = await _tandem(
            capsys, stack, "traffic", "set", ALIAS,
            "--split", f"{v0.name}=90", "--split", f"{v1.name}=10", "--reason", "widen",
        )  # fmt: skip
        assert [s["weight"] for s in policy["split"]] == [90, 10]
        assert await _served_by(stack.client) in {v0.name, v1.name}

        for method, path, expected in (
            ("DELETE", f"/admin/v1/traffic/{ALIAS}?reason=rollback", 200),
            ("DELETE", f"/admin/v1/deployments/{v1.name}?reason=retire", 200),
            ("DELETE", f"/admin/v1/models/{v1.name}?reason=cleanup", 200),
        ):
            response = await stack.admin.request(method, path)
            assert response.status_code == expected, response.text

        entries = await _audit(stack, alias=ALIAS)
        assert [e["seq"] for e in entries] == sorted(e["seq"] for e in entries)
        assert [(e["action"], e["subject"], e["reason"]) for e in entries] == [
            ("version.register", v0.name, "deployed by tandem up at start"),
            ("version.register", v1.name, "a candidate"),
            ("deployment.create", v1.name, "fake engine"),
            ("policy.set", ALIAS, "canary"),
            ("policy.set", ALIAS, "widen"),
            ("policy.delete", ALIAS, "rollback"),
            ("deployment.delete", v1.name, "retire"),
            ("version.delete", v1.name, "cleanup"),
        ]
        assert [e["actor"] for e in entries] == ["config"] + [ADMIN_ACTOR] * 7
        register, deploy, canary_set, widen, delete_policy, undeploy, delete = entries[1:]
        assert register["before"] is None and register["after"]["name"] == v1.name
        assert deploy["before"] is None and deploy["after"]["version"] == v1.name
        assert canary_set["before"] is None and canary_set["after"]["split"][1]["weight"] == 5
        assert widen["before"] == canary_set["after"]
        assert [s["weight"] for s in widen["after"]["split"]] == [90, 10]
        assert delete_policy["before"] == widen["after"] and delete_policy["after"] is None
        assert undeploy["before"]["version"] == v1.name and undeploy["after"] is None
        assert delete["before"]["name"] == v1.name and delete["after"] is None

        everything = await _audit(stack)
        assert [e["alias"] for e in everything].count("other") == 1
        since = await _audit(stack, alias=ALIAS, since=between)
        until = await _audit(stack, alias=ALIAS, until=between)
        assert until + since == entries
        assert [e["action"] for e in until] == [
            "version.register", "version.register", "deployment.create"
        ]  # fmt: skip

        _, from_cli = await _tandem(capsys, stack, "audit", "--alias", ALIAS)
        assert from_cli["data"] == entries
        _, from_cli = await _tandem(capsys, stack, "audit", "--alias", "other")
        assert [e["reason"] for e in from_cli["data"]] == ["another model"]


# --- 7. per-version figures -----------------------------------------------------------------


async def test_figures_count_each_versions_requests_with_their_latencies() -> None:
    async with make_versions_stack(first_with_prefill=True) as stack:
        v0 = stack.versions[0]
        v1 = await stack.add_version(b"v1")
        await stack.set_split((v0, 50), (v1, 50))
        sent: Counter[str] = Counter()
        for version, count in ((v0, 7), (v1, 4)):
            for _ in range(count):
                assert await _served_by(stack.client, version.name) == version.name
            sent[version.name] += count
        for _ in range(3):
            stream = await stack.client.chat.completions.create(
                model=v1.name, messages=QUESTION, max_tokens=4, stream=True
            )
            async for chunk in stream:
                assert chunk.model == v1.name
            sent[v1.name] += 1
        sent.update(await _fan_out(20, 5, lambda _: _served_by(stack.client)))

        for version in (v0, v1):
            figures = await _figures(stack, version.name)
            primary = figures["primary"]
            assert primary["num_requests"] == sent[version.name]
            assert primary["num_errors"] == 0
            for latency in ("ttft", "e2e"):
                quantiles = primary[latency]
                assert quantiles["count"] == sent[version.name]
                assert 0 < quantiles["p50"] <= quantiles["p90"] <= quantiles["p99"]
            assert figures["shadow"]["num_requests"] == 0
        assert (await _figures(stack, v1.name))["primary"]["itl"]["count"] >= 1
        assert v0.prefill is not None and v0.prefill.stats.num_requests == sent[v0.name]
        unknown = await _figures(stack, f"{ALIAS}@00000000")
        assert unknown["primary"]["num_requests"] == 0

        # Failures are the version's errors, a 400 its engine gave as well as a 5xx.
        v1.decode.fail_status, v1.decode.fail_times = 400, 1
        with pytest.raises(openai.BadRequestError):
            await _served_by(stack.client, v1.name)
        v1.decode.fail_status, v1.decode.fail_times = 500, 2  # its one re-run fails too
        with pytest.raises(openai.InternalServerError):
            await _served_by(stack.client, v1.name)
        primary = (await _figures(stack, v1.name))["primary"]
        assert primary["num_requests"] == sent[v1.name] + 2
        assert primary["errors"] == {"engine_error": 1, "invalid_request_error": 1}
        assert primary["e2e"]["count"] == sent[v1.name]  # failures add no latency samples


# --- generation defaults ----------------------------------------------------------------------


async def test_each_version_fills_in_its_own_defaults_shadow_copies_too() -> None:
    async with make_versions_stack() as stack:
        plain = stack.versions[0]
        tuned = await stack.add_version(
            b"v1", {"temperature": 0.25, "system_prompt": "Answer briefly.", "max_tokens": 3}
        )
        await stack.set_split((plain, 100), shadow={"version": tuned.name, "percent": 100})
        assert await _served_by(stack.client) == plain.name
        version, text = await _ask(stack.client, tuned.name)  # no max_tokens: its default
        assert version == tuned.name and len(text.split()) == 3
        await stack.set_split((tuned, 100), shadow={"version": plain.name, "percent": 100})
        assert await _served_by(stack.client) == tuned.name

        async def bodies(engine: FakeEngine, count: int) -> list[dict[str, Any]]:
            deadline = time.monotonic() + 10
            while len(engine.stats.requests) < count:  # the shadow copies arrive on their own
                assert time.monotonic() < deadline, "the shadow copies did not arrive"
                await asyncio.sleep(0.02)
            return [request["body"] for request in engine.stats.requests]

        # plain: primary (as sent), then the copy of tuned's primary (tuned's defaults out).
        for body in await bodies(plain.decode, 2):
            assert "temperature" not in body
            assert [m["role"] for m in body["messages"]] == ["user"]
        # tuned: the copy of plain's primary, its direct request, its primary: its defaults in.
        for body in await bodies(tuned.decode, 3):
            assert body["temperature"] == 0.25
            assert body["messages"][0] == {"role": "system", "content": "Answer briefly."}
            assert body["messages"][1:] == QUESTION


async def test_a_deployed_versions_tokenizer_is_loaded_before_its_first_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its first requests do not wait for it (about 90 ms for SmolLM2's): a rollout's
    candidate would be judged on that wait."""
    loads: list[Path] = []
    for_model = TokenizerCounter.for_model

    def counted(model_dir: Path | None) -> TokenCounter:
        if model_dir is not None:
            loads.append(model_dir)
        return for_model(model_dir)

    monkeypatch.setattr(TokenizerCounter, "for_model", staticmethod(counted))
    async with make_versions_stack() as stack:
        started = list(loads)
        candidate = await stack.add_version(b"v1")
        assert loads == [*started, stack.folder(b"v1")]  # loaded as it was deployed
        await stack.set_split((candidate, 100))
        answers = await asyncio.gather(
            *(
                stack.client.chat.completions.create(
                    model=ALIAS, messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2
                )
                for i in range(4)
            )
        )
        assert {answer.model for answer in answers} == {candidate.name}
        assert loads == [*started, stack.folder(b"v1")]  # its requests loaded nothing
