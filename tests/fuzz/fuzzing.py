"""How the fuzz tests drive schemathesis: its configuration (checks, phases, the gateway's keys),
the hook that points generated requests at the served model, the stateful run's settings, and
the limits of the running gateway.

How much is generated follows ``TANDEM_HYPOTHESIS_PROFILE`` (``tests/properties/profiles.py``):
``ci``, the default, draws a few fixed examples per operation (derandomised: a failure in CI
reproduces anywhere, and the directory fits its share of CI's time); ``thorough`` draws
``THOROUGH_FACTOR`` times more, fresh each run:

    TANDEM_HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests/fuzz
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from schemathesis import HookContext
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.fuzz.gateways import MODEL, Gateway
from tests.properties.profiles import examples, profile_name

SEED = 25
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
RUNNING_LIMITS = {
    # The running gateway's limits, small enough for tests/fuzz/test_limits.py to reach fast
    # and large enough for every fuzzed request.
    "TANDEM_MAX_BODY_BYTES": "262144",
    "TANDEM_BODY_TIMEOUT_S": "1",
    "TANDEM_MAX_HEADER_BYTES": "8192",
    "TANDEM_HEADER_TIMEOUT_S": "1",
}


def fuzz_config(
    gateway: Gateway, ci_examples: int, *, tenant_key: bool = True, coverage: bool = True
) -> schemathesis.Config:
    """Every check and phase, the gateway's keys, ``ci_examples`` per operation in CI.
    ``tenant_key=False`` leaves the OpenAI routes' key to the links (a stateful walk uses
    the keys it issues: a configured key would replace them)."""
    keys = {"AdminKey": {"bearer": gateway.admin_key}}
    if tenant_key:
        keys["TenantKey"] = {"bearer": gateway.tenant_key}
    thorough = profile_name() == "thorough"
    return schemathesis.Config.from_dict(
        {
            "seed": SEED,
            "generation": {
                "max-examples": examples(ci_examples),
                "deterministic": not thorough,
                "database": "none",
            },
            # The stateful run follows the document's own links only, none inferred, with valid
            # inputs (invalid ones are the stateless run's): a walk is about the state it builds.
            "phases": {
                "coverage": {"enabled": coverage},
                "stateful": {
                    "inference": {"algorithms": []},
                    "generation": {"mode": "positive"},
                },
            },
            "checks": {
                # A well-formed request can still be refused for what it means (a period that
                # is not a date, a prompt past the context window, an unknown provider): 400 is
                # an expected answer to schema-valid data. Any 5xx is a failure
                # (not_a_server_error), as is an undocumented status.
                "positive_data_acceptance": {
                    "expected-statuses": ["2xx", "400", "401", "403", "404", "409", "429"]
                },
                # Invalid input may also be too large to read at all (RUNNING_LIMITS).
                "negative_data_rejection": {
                    "expected-statuses": ["400", "401", "403", "404", "405", "409", "413", "429"]
                },
            },
            "auth": {"openapi": keys},
            "max-stream-events": 100_000,
            "request-timeout": 30,
        }
    )


def served_models(schema: OpenApiSchema) -> None:
    """Half the generated valid ``model`` names become the one served, so requests reach the
    engine and its answers (and streams) are checked too; the other half, and invalid ones
    (a negative case's), stay what was generated."""

    @schema.hook
    def flatmap_body(context: HookContext, body: Any) -> st.SearchStrategy[Any]:
        operation = context.operation
        if operation is None or operation.path not in GENERATION_ROUTES:
            return st.just(body)
        if not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return st.just(body)
        if not body["model"]:
            return st.just(body)  # an invalid model on purpose (minLength): keep it invalid
        return st.sampled_from([MODEL, body["model"]]).map(lambda model: {**body, "model": model})


def state_machine_settings(scenarios: int, steps: int) -> settings:
    """Hypothesis settings of a stateful run: ``scenarios`` of up to ``steps``, reported as they
    failed: a scenario changes the gateway's state, so it cannot be replayed or shrunk against
    it (schemathesis' own default)."""
    thorough = profile_name() == "thorough"
    return settings(
        phases=[Phase.generate],
        max_examples=scenarios,
        stateful_step_count=steps,
        derandomize=not thorough,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
