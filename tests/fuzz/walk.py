"""A tenant's life walked through the OpenAPI document's links (schemathesis' state machine):
create a tenant, issue it a key, use the key, revoke it, read the usage.

Besides every check of a single call, the walk holds what a single call cannot show: a key
revoked in a scenario is refused (401) on its next use at once (the gateway that revoked it
drops it from its cache); and that the walk did walk: each step of the life was reached through
the links, so a document whose links broke fails here instead of passing vacuously.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import seed
from hypothesis.errors import Flaky
from schemathesis import Case, Response
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.fuzz.fuzzing import SEED, state_machine_settings
from tests.properties.profiles import examples, profile_name

ISSUE_KEY = "POST /admin/v1/tenants/{tenant}/keys"
REVOKE_KEY = "POST /admin/v1/keys/{key_id}/revoke"
USES_A_KEY = frozenset({"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/usage"})
USED_AN_ISSUED_KEY = "a generation or /v1/usage with a key the walk issued"
USED_A_REVOKED_KEY = "a generation or /v1/usage with a key the walk revoked"
LIFE = (
    ("POST /admin/v1/tenants", 201),
    (ISSUE_KEY, 201),
    (USED_AN_ISSUED_KEY, 200),
    (REVOKE_KEY, 200),
    ("GET /admin/v1/tenants/{tenant}/usage", 200),
)
"""Each step of a tenant's life, and the status that shows it was taken. Using a revoked key
again is checked whenever a scenario does (most runs do), not required: no link carries a
key's secret past its revocation."""
_MORE_BATCHES = 3
"""Batches of scenarios run past the first while a step of the life is still missing:
schemathesis follows a link's parameters only with some probability, so a batch can miss one."""
_MAX_RUNS = 40


def run_tenant_walk(
    schema: OpenApiSchema, checks: list[Callable[..., Any]], ci_examples: int, steps: int
) -> None:
    """Run the state machine of ``schema``'s links: ``ci_examples`` scenarios of up to ``steps``
    (in CI), ``checks`` on every answer; more rounds while a step of the life is missing."""
    reached: set[tuple[str, int]] = set()
    failures: list[BaseException] = []
    scenarios = [0]
    delete_tenant = schema["/admin/v1/tenants/{tenant}"]["DELETE"]

    class TenantWalk(schema.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            self.created: list[str] = []  # tenant ids
            self.issued: dict[str, str] = {}  # key id -> the key
            self.revoked: set[str] = set()

        def teardown(self) -> None:
            # Each scenario starts from the same gateway: what one created would answer the
            # next one's same calls differently (a 409 for a name taken).
            for tenant_id in self.created:
                delete_tenant.Case(path_parameters={"tenant": tenant_id}).call()
            scenarios[0] += 1
            super().teardown()

        def validate_response(
            self, response: Response, case: Case, additional_checks: Any = None, **kwargs: Any
        ) -> None:
            try:
                self._validate(response, case, **kwargs)
            except BaseException as exc:
                failures.append(exc)
                raise

        def _validate(self, response: Response, case: Case, **kwargs: Any) -> None:
            super().validate_response(response, case, additional_checks=checks, **kwargs)
            label, status = case.operation.label, response.status_code
            sent_key = _bearer(response)
            if label in USES_A_KEY:
                if sent_key in self.revoked:
                    assert status == 401, (
                        f"{label} with a key revoked earlier in this scenario answered "
                        f"{status}: {response.content[:300]!r}"
                    )
                    reached.add((USED_A_REVOKED_KEY, status))
                elif sent_key in self.issued.values():
                    reached.add((USED_AN_ISSUED_KEY, status))
                return
            reached.add((label, status))
            if label == "POST /admin/v1/tenants" and status == 201:
                self.created.append(response.json()["tenant_id"])
            elif label == ISSUE_KEY and status == 201:
                issued = response.json()
                self.issued[issued["key_id"]] = issued["key"]
            elif label == REVOKE_KEY and status == 200:
                key = self.issued.get(response.json()["key_id"])
                if key is not None:
                    self.revoked.add(key)

    def missing() -> list[tuple[str, int]]:
        return [step for step in LIFE if step not in reached]

    batch = examples(ci_examples)
    target = batch
    thorough = profile_name() == "thorough"
    for run in range(_MAX_RUNS):
        if scenarios[0] >= target:
            if not missing() or target >= batch * (1 + _MORE_BATCHES):
                break
            target += batch
        # A seed per run: each draws other scenarios, and CI's are always the same ones.
        machine = TenantWalk if thorough else seed(SEED + run)(TenantWalk)
        try:
            machine.run(settings=state_machine_settings(target - scenarios[0], steps))
        except Flaky:
            # Which steps schemathesis allows depends on what earlier scenarios did (it spreads
            # calls over the links), so a prefix hypothesis draws again can meet other choices,
            # and hypothesis stops the run. A check that failed was recorded as it happened;
            # otherwise the walk goes on (schemathesis' own runner does the same).
            if failures:
                raise failures[0] from None
        if failures:
            raise failures[0]
    assert not missing(), f"the walk never reached {missing()}; it reached {sorted(reached)}"


def _bearer(response: Response) -> str | None:
    header = response.request.headers.get("Authorization") or ""
    return header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
