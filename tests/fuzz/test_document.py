"""The OpenAPI document and the fuzz checks, without a gateway running: the document declares
every error as OpenAI's body and links a tenant's life, and the checks fail on what they must
(so a fuzz run that passes has passed something)."""

from __future__ import annotations

from typing import Any

import pytest
import requests
import schemathesis
from schemathesis import Response
from schemathesis.core.failures import FailureGroup

from core.messages import WorkerRole
from core.models import ServedModel
from gateway.assembly.app import GatewayConfig, create_app
from gateway.serving.upstream import UpstreamConfig
from tests.fuzz.checks import assert_openai_error, stream_problems
from workers.deployments import Deployment, Deployments
from workers.pool import PoolConfig, WorkerPool

MODEL = "m"
ERROR_REF = {"$ref": "#/components/schemas/Error"}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    """The document of an app whose workers never start (the document needs none)."""
    pools = [
        WorkerPool(PoolConfig(role, external_urls=("http://127.0.0.1:9",)))
        for role in (WorkerRole.PREFILL, WorkerRole.DECODE)
    ]
    deployment = Deployment(ServedModel(MODEL, 256, 0), pools[0], pools[1])
    app = create_app(GatewayConfig(upstream=UpstreamConfig()), Deployments([deployment]))
    return app.openapi()


def _operations(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (method, path, operation)
        for path, methods in document["paths"].items()
        for method, operation in methods.items()
    ]


def test_every_error_is_declared_as_an_openai_error(document: dict[str, Any]) -> None:
    for method, path, operation in _operations(document):
        errors = {code: r for code, r in operation["responses"].items() if code >= "400"}
        assert {"400", "408", "413", "431"} <= set(errors), (method, path)
        if path.startswith(("/v1/", "/admin/")):
            assert {"401", "429"} <= set(errors), (method, path)
        for code, response in errors.items():
            if (method, path, code) == ("get", "/ready", "503"):
                continue  # not ready is a readiness report, not an error
            assert response["content"] == {"application/json": {"schema": ERROR_REF}}, (
                method,
                path,
                code,
            )
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # FastAPI's {"detail": ...}: never sent
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]


def test_every_operation_says_who_may_call_it(document: dict[str, Any]) -> None:
    for _, path, operation in _operations(document):
        names = {p["name"].lower() for p in operation.get("parameters", [])}
        assert "authorization" not in names, path  # a security scheme, not a header parameter
        if path.startswith("/admin/"):
            assert operation["security"] == [{"AdminKey": []}], path
        elif path.startswith("/v1/"):
            assert operation["security"] == [{"TenantKey": []}], path


def test_the_links_walk_a_tenants_life_and_resolve(document: dict[str, Any]) -> None:
    links = {
        name: (method, path, link)
        for method, path, operation in _operations(document)
        for response in operation["responses"].values()
        for name, link in response.get("links", {}).items()
    }
    life = {"IssueKey", "ChatWithKey", "CompleteWithKey", "RevokeKey", "UsageAfterRevoke"}
    assert life <= set(links)
    for name, (_, _, link) in links.items():
        _, _, pointer = link["operationRef"].partition("#/paths/")
        raw_path, _, method = pointer.rpartition("/")
        target_path = raw_path.replace("~1", "/").replace("~0", "~")
        target = document["paths"][target_path][method]  # KeyError: a link to nowhere
        declared = {p["name"] for p in target.get("parameters", []) if p["in"] == "path"}
        linked = {k.split(".", 1)[1] for k in link["parameters"] if k.startswith("path.")}
        assert linked == declared, name


def test_the_generation_routes_document_their_bodies_and_streams(
    document: dict[str, Any],
) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        operation = document["paths"][path]["post"]
        examples = operation["requestBody"]["content"]["application/json"]["examples"]
        assert any(example["value"].get("stream") for example in examples.values())
        assert all(example["value"]["model"] == MODEL for example in examples.values())
        assert set(operation["responses"]["200"]["content"]) == {
            "application/json",
            "text/event-stream",
        }


GOOD_STREAM = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}'
    b"\n\n: ping\n\n"
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
    b"data: [DONE]\n\n"
)


def test_a_stream_by_the_wire_contract_passes() -> None:
    assert stream_problems(GOOD_STREAM, "/v1/chat/completions", asked_usage=False) == []


@pytest.mark.parametrize(
    ("stream", "asked_usage"),
    [
        (GOOD_STREAM.replace(b"\n\n", b"\r\n\r\n"), False),  # separators are \n only
        (b"event: message\n" + GOOD_STREAM, False),  # no event:, id: or retry: lines
        (GOOD_STREAM.removesuffix(b"data: [DONE]\n\n"), False),  # no [DONE]
        (GOOD_STREAM.replace(b'"finish_reason":"stop"', b'"finish_reason":null'), False),
        (GOOD_STREAM.replace(b'"created":1,', b'"created":2,', 1), False),  # one created
        (GOOD_STREAM.replace(b"chat.completion.chunk", b"chat.completion", 1), False),
        (GOOD_STREAM, True),  # usage asked for, none sent
        (GOOD_STREAM.replace(b"}]}\n\n", b'}],"usage":null}\n\n'), False),  # not asked for
        (
            GOOD_STREAM.replace(
                b"data: [DONE]", b'data: {"error":{"message":"x","type":"t","code":5}}'
            ),
            False,
        ),  # an error event's code is a string or null
        (b'data: {"error":{"message":"x","type":"t","param":null,"code":null}}\n\n' + GOOD_STREAM,
         False),  # an error event ends the stream
    ],
)  # fmt: skip
def test_a_stream_breaking_the_wire_contract_is_caught(stream: bytes, asked_usage: bool) -> None:
    assert stream_problems(stream, "/v1/chat/completions", asked_usage)


@pytest.mark.parametrize(
    "body",
    [
        {"detail": "Not Found"},
        {"error": {"message": "x", "type": "t", "param": None}},
        {"error": {"message": "x", "type": "t", "param": None, "code": 404}},
        {"error": {"message": "", "type": "t", "param": None, "code": None}},
        {"error": {"message": "x", "type": "t", "param": None, "code": None, "extra": 1}},
    ],
)
def test_an_error_not_in_openais_shape_is_caught(body: dict[str, Any]) -> None:
    with pytest.raises(AssertionError):
        assert_openai_error(body)


def test_the_document_refuses_a_chunk_out_of_shape(document: dict[str, Any]) -> None:
    schema = schemathesis.openapi.from_dict(document)
    case = schema["/v1/chat/completions"]["POST"].Case(
        body={"model": MODEL, "messages": [], "stream": True}
    )
    bad = GOOD_STREAM.replace(b'"created":1', b'"created":"yesterday"')
    for content, fails in ((GOOD_STREAM, False), (bad, True)):
        response = _response(200, "text/event-stream", content)
        if fails:
            with pytest.raises(FailureGroup, match="SSE event violates schema"):
                case.validate_response(response, checks=_schema_check())
        else:
            case.validate_response(response, checks=_schema_check())


def _schema_check() -> list[Any]:
    from schemathesis.specs.openapi.checks import response_schema_conformance

    return [response_schema_conformance]


def _response(status: int, content_type: str, content: bytes) -> Response:
    request = requests.Request("POST", "http://gateway/v1/chat/completions").prepare()
    return Response(
        status_code=status,
        headers={"content-type": [content_type]},
        content=content,
        request=request,
        elapsed=0.0,
        verify=True,
    )
