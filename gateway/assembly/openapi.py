"""The gateway's OpenAPI document (``GET /openapi.json``): FastAPI's, completed with what the
routes' signatures cannot say, so that a client generator, or the fuzzer of ``tests/fuzz``,
can hold every answer to it:

- every error, under each status an operation can answer, as OpenAI's error body (``Error``),
  and no FastAPI ``422 {"detail": ...}``, which the gateway never sends (``gateway/errors.py``
  makes a bad field a 400 naming it);
- who may call: the admin key on ``/admin/v1`` (and ``/metrics`` from another host), a
  tenant's key on ``/v1`` (bearer schemes ``AdminKey`` and ``TenantKey``, instead of a bare
  ``authorization`` header parameter);
- the request bodies of the routes that read their own JSON (``gateway/serving/routes.py``
  parses it once, outside FastAPI, to keep the hot path short);
- the answers of the OpenAI routes (JSON, or an SSE stream) and of the tenants' API
  (``gateway/assembly/api_shapes.py``);
- links that walk a tenant's life: create it, issue a key, use the key, revoke it, read the
  usage (OpenAPI links; the stateful fuzz run follows them);
- the models served when the document was first asked for: ``model``'s examples, the model
  of the OpenAI routes' example requests (a streamed one among them) and of a link's request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from billing.export import ExportFormat, content_type
from gateway.assembly import api_shapes as shapes
from gateway.serving.schemas import ChatCompletionRequest, CompletionRequest

ADMIN_KEY = "AdminKey"
TENANT_KEY = "TenantKey"
_SECURITY_SCHEMES = {
    ADMIN_KEY: {
        "type": "http",
        "scheme": "bearer",
        "description": "The admin key: TANDEM_ADMIN_KEY, or the one generated into "
        "TANDEM_STATE_DIR/admin.key.",
    },
    TENANT_KEY: {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key (POST /admin/v1/tenants/{tenant}/keys).",
    },
}

_ERROR_STATUSES = {
    400: "A bad body, parameter or header; `param` names the field.",
    401: "No key, or an unknown or revoked one.",
    403: "A tenant's key on the admin API.",
    404: "No such model or resource.",
    408: "The request's head or body did not arrive in time (TANDEM_HEADER_TIMEOUT_S, "
    "TANDEM_BODY_TIMEOUT_S).",
    409: "Conflicts with the current state, or the same Idempotency-Key is still running.",
    413: "The body is larger than TANDEM_MAX_BODY_BYTES.",
    422: "The Idempotency-Key was used before with another body.",
    429: "Rate limited, quota or budget exhausted, or too many failed authentications.",
    431: "The request line and headers are larger than TANDEM_MAX_HEADER_BYTES.",
    502: "A worker failed or answered something that is not vLLM's protocol.",
    503: "Unavailable for now (no healthy worker, overloaded, a store down); see retry-after.",
    504: "The request's deadline passed, or a worker did not answer in time.",
}
_ANY_REQUEST = (400, 408, 413, 431)
"""What any request may get: the limits of ``gateway/limits.py`` and the HTTP server."""
_AUTHENTICATED = (401, 429)
_GENERATION = (*_AUTHENTICATED, 404, 409, 422, 502, 503, 504)
_ADMIN = (*_AUTHENTICATED, 403, 404, 409, 503)

_OWN_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/v1/chat/completions"): ChatCompletionRequest,
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/moderations"): shapes.ModerationRequest,
}
_STREAMED: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": shapes.ChatCompletionChunkShape,
    "/v1/completions": shapes.CompletionChunkShape,
}
"""Their 200 is JSON, or with ``stream: true`` an SSE stream of these chunks (docs/WIRE.md)."""

_HELLO = [{"role": "user", "content": "Say hello."}]
_EXAMPLES: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "/v1/chat/completions": {
        "streamed": (
            "A streamed chat with its usage",
            {"messages": _HELLO, "max_tokens": 8, "stream": True,
             "stream_options": {"include_usage": True}},
        ),
        "answered": ("A chat answered at once", {"messages": _HELLO, "max_tokens": 8}),
    },
    "/v1/completions": {
        "streamed": ("Two streamed completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                 "n": 2, "stream": True}),
        "answered": ("A completion answered at once", {"prompt": "Once upon a time",
                                                       "max_tokens": 8}),
    },
}  # fmt: skip
"""Example requests of the OpenAI routes (their ``model`` is the first served)."""

_ANSWERS: dict[tuple[str, str], tuple[str, type[BaseModel]]] = {
    ("post", "/v1/chat/completions"): ("200", shapes.ChatCompletionShape),
    ("post", "/v1/completions"): ("200", shapes.CompletionShape),
    ("get", "/v1/models"): ("200", shapes.ModelList),
    ("post", "/v1/moderations"): ("200", shapes.ModerationShape),
    ("post", "/admin/v1/tenants"): ("201", shapes.TenantShape),
    ("get", "/admin/v1/tenants"): ("200", shapes.TenantList),
    ("get", "/admin/v1/tenants/{tenant}"): ("200", shapes.TenantShape),
    ("patch", "/admin/v1/tenants/{tenant}"): ("200", shapes.TenantShape),
    ("delete", "/admin/v1/tenants/{tenant}"): ("200", shapes.TenantDeleted),
    ("post", "/admin/v1/tenants/{tenant}/keys"): ("201", shapes.IssuedKeyShape),
    ("get", "/admin/v1/tenants/{tenant}/keys"): ("200", shapes.KeyList),
    ("post", "/admin/v1/keys/{key_id}/revoke"): ("200", shapes.KeyShape),
    ("get", "/admin/v1/tenants/{tenant}/usage"): ("200", shapes.TenantUsageShape),
    ("get", "/health"): ("200", shapes.Health),
    ("get", "/ready"): ("200", shapes.Readiness),
}
_EXPORTS = tuple(content_type(fmt).split(";")[0] for fmt in ExportFormat)
_MEDIA: dict[tuple[str, str], tuple[str, ...]] = {
    # Success answers that are not (only) JSON: their media types, each a string.
    ("get", "/metrics"): ("text/plain", "application/openmetrics-text"),
    ("get", "/admin/v1/billing/export"): _EXPORTS,
    ("get", "/v1/usage"): ("application/json", *_EXPORTS),
    ("get", "/admin/v1/rollouts/{rollout_id}/report/{name}"): (
        "image/png",
        "text/markdown",
        "application/json",
    ),
}
_OTHER_ANSWERS: dict[tuple[str, str], dict[str, tuple[str, type[BaseModel] | None]]] = {
    # Routes that answer more than FastAPI's one success status.
    ("get", "/ready"): {
        "503": ("Not ready: a deployed version cannot serve now.", shapes.Readiness)
    },
    ("post", "/admin/v1/models"): {"201": ("Registered (200: it was already).", None)},
    ("post", "/admin/v1/rollouts/{rollout_id}/{action}"): {
        "202": ("Queued, not applied yet: the rollout as it stands.", None)
    },
}

_TENANT = "/admin/v1/tenants/{tenant}"
_LINKS: dict[tuple[str, str], dict[str, tuple[tuple[str, str], dict[str, str]]]] = {
    # A tenant's life: create -> issue a key -> use it -> revoke it -> its usage.
    ("post", "/admin/v1/tenants"): {
        "IssueKey": (("post", f"{_TENANT}/keys"), {"path.tenant": "$response.body#/tenant_id"}),
        "GetTenant": (("get", _TENANT), {"path.tenant": "$response.body#/tenant_id"}),
        "UpdateTenant": (("patch", _TENANT), {"path.tenant": "$response.body#/tenant_id"}),
        "TenantUsage": (("get", f"{_TENANT}/usage"), {"path.tenant": "$response.body#/tenant_id"}),
        "DeleteTenant": (("delete", _TENANT), {"path.tenant": "$response.body#/tenant_id"}),
    },
    ("post", f"{_TENANT}/keys"): {
        "ChatWithKey": (
            ("post", "/v1/chat/completions"),
            {"header.Authorization": "Bearer {$response.body#/key}"},
        ),
        "CompleteWithKey": (
            ("post", "/v1/completions"),
            {"header.Authorization": "Bearer {$response.body#/key}"},
        ),
        "OwnUsage": (
            ("get", "/v1/usage"),
            {"header.Authorization": "Bearer {$response.body#/key}"},
        ),
        "ListKeys": (("get", f"{_TENANT}/keys"), {"path.tenant": "$response.body#/tenant_id"}),
        "RevokeKey": (
            ("post", "/admin/v1/keys/{key_id}/revoke"),
            {"path.key_id": "$response.body#/key_id"},
        ),
    },
    ("post", "/admin/v1/keys/{key_id}/revoke"): {
        "UsageAfterRevoke": (
            ("get", f"{_TENANT}/usage"),
            {"path.tenant": "$response.body#/tenant_id"},
        ),
        "KeysAfterRevoke": (
            ("get", f"{_TENANT}/keys"),
            {"path.tenant": "$response.body#/tenant_id"},
        ),
    },
}


def install_openapi(app: FastAPI, served: Callable[[], list[str]]) -> None:
    """Serve ``openapi_document`` as the app's ``/openapi.json`` (built once, on first use, with
    the aliases ``served`` names then)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app, served())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override


def openapi_document(app: FastAPI, served: list[str]) -> dict[str, Any]:
    """FastAPI's document of ``app`` serving the aliases ``served``, completed as the module
    docstring says."""
    document = get_openapi(
        title=app.title, version=app.version, description=app.description, routes=app.routes
    )
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    error = _schema_ref(schemas, shapes.Error)
    for method, path, operation in _operations(document):
        key = (method, path)
        responses = operation.setdefault("responses", {})
        responses.pop("422", None)  # FastAPI's validation body; ours is a 400 (gateway/errors.py)
        operation["parameters"] = [
            p for p in operation.get("parameters", []) if p["name"].lower() != "authorization"
        ]
        if not operation["parameters"]:
            del operation["parameters"]
        if (security := _security_of(path)) is not None:
            operation["security"] = security
        if (body := _OWN_BODIES.get(key)) is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": _schema_ref(schemas, body)}},
            }
            model = schemas[body.__name__].get("properties", {}).get("model")
            if model is not None and served:
                model["examples"] = served
            if path in _EXAMPLES and served:
                operation["requestBody"]["content"]["application/json"]["examples"] = {
                    name: {"summary": summary, "value": {"model": served[0], **value}}
                    for name, (summary, value) in _EXAMPLES[path].items()
                }
        if (answer := _ANSWERS.get(key)) is not None:
            status, shape = answer
            content = {"application/json": {"schema": _schema_ref(schemas, shape)}}
            if (chunk := _STREAMED.get(path)) is not None:
                content["text/event-stream"] = {
                    "schema": _stream_event(_schema_ref(schemas, chunk), error)
                }
            responses[status] = {"description": shape.__doc__ or "Success.", "content": content}
        if (media := _MEDIA.get(key)) is not None:
            success = next(code for code in responses if code.startswith("2"))
            responses[success]["content"] = {
                kind: {"schema": {"type": "object"} if kind == "application/json" else {}}
                for kind in media
            }
        for status, (description, other) in _OTHER_ANSWERS.get(key, {}).items():
            schema = {"type": "object"} if other is None else _schema_ref(schemas, other)
            responses[status] = {
                "description": description,
                "content": {"application/json": {"schema": schema}},
            }
        for code in _errors_of(path):
            responses.setdefault(
                str(code),
                {
                    "description": _ERROR_STATUSES[code],
                    "content": {"application/json": {"schema": error}},
                },
            )
        for status, links in _links_of(key, responses, served).items():
            responses[status]["links"] = links
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    components["securitySchemes"] = _SECURITY_SCHEMES
    return document


def _operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document.get("paths", {}).items():
        for method, operation in methods.items():
            yield method, path, operation


def _security_of(path: str) -> list[dict[str, list[str]]] | None:
    if path.startswith("/admin/"):
        return [{ADMIN_KEY: []}]
    if path.startswith("/v1/"):
        return [{TENANT_KEY: []}]
    if path == "/metrics":
        # Open to clients on the gateway's host (or everyone with TANDEM_METRICS_PUBLIC).
        return [{ADMIN_KEY: []}, {}]
    return None  # /health, /ready


def _errors_of(path: str) -> tuple[int, ...]:
    if path.startswith("/admin/"):
        return (*_ANY_REQUEST, *_ADMIN)
    if path in _STREAMED:
        return (*_ANY_REQUEST, *_GENERATION)
    if path == "/v1/moderations":
        return (*_ANY_REQUEST, *_AUTHENTICATED, 503)  # a fail-closed provider that failed
    if path == "/v1/usage":
        return (*_ANY_REQUEST, *_AUTHENTICATED, 404, 503)  # billing off; the ledger down
    if path.startswith("/v1/"):
        return (*_ANY_REQUEST, *_AUTHENTICATED)
    if path == "/metrics":
        return (*_ANY_REQUEST, *_AUTHENTICATED, 403)
    return _ANY_REQUEST


def _links_of(
    key: tuple[str, str], responses: dict[str, Any], served: list[str]
) -> dict[str, dict[str, dict[str, Any]]]:
    links = _LINKS.get(key)
    if not links:
        return {}
    status = next(code for code in responses if code.startswith("2"))
    described = {}
    for name, (target, parameters) in links.items():
        link: dict[str, Any] = {"operationRef": _operation_ref(*target), "parameters": parameters}
        if target[1] in _STREAMED and served:
            link["requestBody"] = {"model": served[0]}  # a model this gateway serves
        described[name] = link
    return {status: described}


def _stream_event(chunk: dict[str, str], error: dict[str, str]) -> dict[str, Any]:
    """One event of an OpenAI stream: a chunk, an error (then the stream ends), or the last
    ``[DONE]``; heartbeats are comments, not events."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [chunk, error]},
                    },
                ]
            }
        },
    }


def _operation_ref(method: str, path: str) -> str:
    """A JSON pointer to an operation of this document (RFC 6901: ``~1`` is ``/``)."""
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method


def _schema_ref(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """``model``'s JSON schema (and those it uses) among the components; a reference to it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, definition in schema.pop("$defs", {}).items():
        schemas.setdefault(name, definition)
    schemas[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}
