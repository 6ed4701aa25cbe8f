"""Rendering every error as OpenAI's ``{"error": {...}}`` body: the only place that does it."""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope

from core.errors import InvalidRequestError, TandemError

log = logging.getLogger("tandem.gateway")

_HTTP_STATUS_CODES = {404: "not_found", 405: "method_not_allowed"}

# Where FastAPI found a bad value; OpenAI's ``param`` is the field alone.
_LOCATIONS = frozenset({"body", "query", "path", "header", "cookie"})
# Pydantic puts the union branch it tried into an error's location ("str", "list[str]",
# "constrained-str", a model's class name, "[key]"); a field name or JSON key is none of these.
_UNION_BRANCH = re.compile(r"[^a-z0-9_]|^(?:str|int|float|bool|bytes|none)$")


def error_response(exc: TandemError) -> Response:
    """The HTTP response for a Tandem error, with its retry hints as headers."""
    return Response(
        orjson.dumps(exc.to_body()),
        status_code=exc.status_code,
        media_type="application/json",
        headers=exc.headers(),
    )


def invalid_request_from_validation(exc: ValidationError | RequestValidationError) -> TandemError:
    """A 400 naming the first offending field, as OpenAI does (``param`` is its dotted path,
    without FastAPI's ``body``/``query``/``path`` prefix)."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":  # FastAPI's body parse; its "loc" is an offset
        return InvalidRequestError(
            "We could not parse the JSON body of your request: send a JSON object with "
            "Content-Type: application/json."
        )
    location = list(first.get("loc", ()))
    if location and location[0] in _LOCATIONS:
        location = location[1:]
    fields = [
        str(part) for part in location if isinstance(part, int) or not _UNION_BRANCH.search(part)
    ]
    param = ".".join(fields) or None
    message = str(first.get("msg", "invalid value"))
    where = f"'{param}'" if param else "the request body"
    return InvalidRequestError(f"Invalid value for {where}: {message}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Make every failure, including framework ones, leave as an OpenAI error body."""

    async def on_tandem_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, TandemError)  # registered for TandemError only
        return error_response(exc)

    async def on_validation_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(invalid_request_from_validation(exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = InvalidRequestError if exc.status_code < 500 else TandemError
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette's Allow names the first route on the path only; HTTP wants them all.
            headers["Allow"] = ", ".join(_allowed_methods(request))
        error = kind(
            f"{request.method} {request.url.path}: {exc.detail}",
            code=_HTTP_STATUS_CODES.get(exc.status_code),
            extra_headers=headers,
        )
        error.status_code = exc.status_code
        return error_response(error)

    async def on_unexpected_error(request: Request, exc: Exception) -> Response:
        # The one catch-all: a bug must still answer in OpenAI's shape, and be logged in full.
        log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(TandemError("The gateway hit an internal error; it was logged."))

    app.add_exception_handler(TandemError, on_tandem_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves on the request's path."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if route.matches(request.scope)[0] is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods)


ExceptionHandler = Callable[[Request, Exception], Awaitable[Response] | Response]


def handler_for(scope: Scope, exc: Exception) -> ExceptionHandler | None:
    """The handler the scope's app registered for ``exc`` (by status code for an HTTP
    exception, else by the nearest class in its MRO), as starlette's ``ExceptionMiddleware``
    picks it; None for one only the catch-all handles (``Exception``, 500), which stays the
    outermost middleware's, as in any starlette app."""
    handlers: dict[Any, ExceptionHandler] = getattr(scope.get("app"), "exception_handlers", {})
    if isinstance(exc, StarletteHTTPException) and (by_status := handlers.get(exc.status_code)):
        return by_status
    for kind in type(exc).__mro__:
        if kind is Exception:
            return None
        if (handler := handlers.get(kind)) is not None:
            return handler
    return None


async def handled_response(exc: Exception, scope: Scope, receive: Receive) -> Response | None:
    """The response the app's handler for ``exc`` gives, for code that serves a request past
    starlette's ``ExceptionMiddleware`` (``gateway/serving/routes.py``'s raw routes, a stream
    that fails before it commits); None when only the catch-all handles it: the caller raises
    it again, and the outermost middleware answers the bug with a 500 and logs it."""
    handler = handler_for(scope, exc)
    if handler is None:
        return None
    handled = handler(Request(scope, receive), exc)
    return await handled if inspect.isawaitable(handled) else handled
