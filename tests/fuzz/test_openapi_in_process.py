"""Every operation of the gateway's OpenAPI document, fuzzed in-process (ASGI) on fake engines:
valid and invalid inputs, then a tenant's life walked through the document's links.

Each answer must pass schemathesis' checks (no 5xx; status, content type, headers and body as
documented; schema-invalid input refused, schema-valid input not refused but for what it means;
auth enforced; 405s with a true ``Allow``; a deleted tenant gone) and ours (``checks.py``:
OpenAI's error body, streams by the wire contract).
"""

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


@pytest.fixture
def in_process_schema(in_process: Gateway) -> OpenApiSchema:
    schema = schemathesis.openapi.from_asgi(
        "/openapi.json", in_process.app, config=fuzz_config(in_process, ci_examples=6)
    )
    served_models(schema)
    return schema


schema = schemathesis.pytest.from_fixture("in_process_schema")


@schema.parametrize()
def test_every_operation_answers_as_documented(case: Case) -> None:
    case.call_and_validate(additional_checks=CHECKS)


def test_a_tenants_life_through_the_links(in_process: Gateway) -> None:
    walk_schema = schemathesis.openapi.from_asgi(
        "/openapi.json", in_process.app, config=fuzz_config(in_process, 0, tenant_key=False)
    )
    run_tenant_walk(walk_schema, CHECKS, ci_examples=30, steps=10)
