"""The same fuzzing against ``tandem up`` as a process: the production HTTP server (uvicorn on
httptools with the gateway's own protocol, ``gateway/cli/http_protocol.py``), its settings
read from ``TANDEM_*``, real sockets and keep-alive connections, over a fake engine process.
Fewer examples than in-process: what differs here is the server around the app."""

from __future__ import annotations

import pytest
import schemathesis
from schemathesis import Case
from schemathesis.specs.openapi.schemas import OpenApiSchema

from tests.fuzz.checks import openai_error, sse_stream
from tests.fuzz.fuzzing import fuzz_config, served_models
from tests.fuzz.gateways import Gateway
from tests.fuzz.walk import run_tenant_walk

CHECKS = [openai_error, sse_stream]


@pytest.fixture(scope="module")
def running_schema(running: Gateway) -> OpenApiSchema:
    schema = schemathesis.openapi.from_url(
        f"{running.base_url}/openapi.json",
        config=fuzz_config(running, ci_examples=4, coverage=False),
    )
    served_models(schema)
    return schema


schema = schemathesis.pytest.from_fixture("running_schema")


@schema.parametrize()
def test_every_operation_answers_as_documented(case: Case) -> None:
    case.call_and_validate(additional_checks=CHECKS)


def test_a_tenants_life_through_the_links(running: Gateway) -> None:
    walk_schema = schemathesis.openapi.from_url(
        f"{running.base_url}/openapi.json", config=fuzz_config(running, 0, tenant_key=False)
    )
    run_tenant_walk(walk_schema, CHECKS, ci_examples=10, steps=10)
