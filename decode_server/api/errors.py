"""Map every failure at the HTTP edge to an OpenAI-style JSON error with the right status.

`{"error": {"message", "type", "param", "code"}}`: typed `DecodeServerError`s carry their own status; FastAPI's
request-validation errors (its default is 422) and malformed JSON become 400 with the offending field as
`param`; a full waiting queue or a dead engine becomes 503 with `Retry-After`; anything unexpected is a 500
whose message does not leak internals (the traceback goes to the log).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from decode_server.api.protocol import ErrorInfo, ErrorResponse
from decode_server.errors import DecodeServerError, EngineDeadError, QueueFullError

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


def error_body(message: str, error_type: str, status: int, param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(
        error=ErrorInfo(message=message, type=error_type, param=param, code=status)
    ).model_dump()


def error_response(exc: DecodeServerError) -> JSONResponse:
    headers = {}
    if isinstance(exc, QueueFullError | EngineDeadError):
        headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
    return JSONResponse(
        error_body(exc.message, exc.error_type, exc.status_code, exc.param),
        status_code=exc.status_code,
        headers=headers,
    )


def _param_of(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages.0.content'; the leading 'body' is not a parameter."""
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    # pydantic reports which branch of a union failed (e.g. 'str', 'list[int]'); that is noise for clients.
    parts = [
        p for p in parts if not p.startswith(("list[", "function-", "json-or-python")) and p not in _TYPES
    ]
    return ".".join(parts) or None


_TYPES = {"str", "int", "float", "bool", "dict", "list", "none", "constrained-int", "constrained-float",
          "constrained-str"}


def validation_error_response(errors: Sequence[Any]) -> JSONResponse:
    """FastAPI's validation errors (422 by default) as one 400 naming the first offending parameter."""
    if not errors:
        return JSONResponse(error_body("invalid request", "invalid_request_error", 400), status_code=400)
    first = errors[0]
    loc = first.get("loc", ())
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        message = f"request body is not valid JSON: {ctx.get('error', 'parse error')}"
        return JSONResponse(error_body(message, "invalid_request_error", 400), status_code=400)
    param = _param_of(loc)
    msg = first.get("msg", "invalid value")
    if first.get("type") == "missing":
        message = f"missing required parameter '{param}'" if param else "request body is required"
    elif first.get("type") == "model_attributes_type" or (param is None and first.get("type") == "dict_type"):
        message = "request body must be a JSON object"
    else:
        message = f"invalid value for '{param}': {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return JSONResponse(error_body(message, "invalid_request_error", 400, param), status_code=400)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DecodeServerError)
    async def _typed(_: Request, exc: DecodeServerError) -> JSONResponse:
        if exc.status_code >= 500:
            logger.warning("request failed: %s", exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc.errors())

    @app.exception_handler(json.JSONDecodeError)
    async def _bad_json(_: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return JSONResponse(
            error_body(f"request body is not valid JSON: {exc}", "invalid_request_error", 400),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "internal_error"
        )
        return JSONResponse(
            error_body(str(exc.detail), error_type, exc.status_code),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", "internal_error", 500), status_code=500
        )
