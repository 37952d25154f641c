"""One error shape for every 4xx, `{"error": {"code", "message", "param"}}`, and the handlers that make it.

Engine errors (`opd_trainer.errors.OPDError`) become 400 with `param` = their `field`; request
validation errors become 422 naming the first bad field; a database that cannot be reached is a 503
with `Retry-After`; anything unexpected is logged and answered with a 500 of the same shape, never a
stack trace.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.db import database_unavailable
from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_spec import error_field_path

logger = logging.getLogger(__name__)

DATABASE_RETRY_AFTER_S = 5


class ErrorBody(BaseModel):
    code: str = Field(description="Machine-readable reason, e.g. `invalid_config`, `not_found`.")
    message: str = Field(description="What is wrong, for people.")
    param: str | None = Field(default=None, description="The field or parameter at fault, if one is.")


class ErrorResponse(BaseModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "error": {
                        "code": "invalid_config",
                        "message": "Input should be greater than or equal to 1",
                        "param": "hyper_parameters.batch_size",
                    }
                }
            ]
        }
    )

    error: ErrorBody = Field(description="The one error shape of every 4xx and 5xx answer.")


class APIError(Exception):
    """An error a route or service raises on purpose; becomes `status` with the error shape."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


def not_found(kind: str, ident: str, param: str | None = None) -> APIError:
    # A tenant gets the same answer for another tenant's object as for a missing one.
    return APIError(404, "not_found", f"no {kind} with id {ident!r}", param)


def error_response(status: int, code: str, message: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(code=code, message=message, param=param))
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def field_path(location: tuple[Any, ...] | list[Any]) -> str | None:
    """`("body", "hyper_parameters", "batch_size")` → `hyper_parameters.batch_size`."""
    parts = list(location)
    if parts and parts[0] in {"body", "query", "path", "header", "cookie"}:
        parts = parts[1:]
    return error_field_path(parts) if parts else None


def _validation_message(errors: list[dict[str, Any]]) -> str:
    first, *rest = errors
    message = str(first.get("msg", "invalid value"))
    if rest:
        message += "; also " + "; ".join(
            f"{field_path(e.get('loc', ())) or '(body)'}: {e.get('msg', 'invalid value')}" for e in rest[:10]
        )
    return message


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.code, exc.message, exc.param)

    @app.exception_handler(OPDError)
    async def _opd_error(_request: Request, exc: OPDError) -> JSONResponse:
        return error_response(400, "invalid_" + _snake(type(exc).__name__), exc.message, exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if not errors:
            return error_response(422, "invalid_request", "invalid request")
        if errors[0].get("type") == "json_invalid":
            # Its location is a character offset, not a field.
            where = errors[0].get("loc", ("body", "?"))[-1]
            reason = (errors[0].get("ctx") or {}).get("error", "invalid JSON")
            message = f"body is not valid JSON at character {where}: {reason}"
            return error_response(422, "invalid_json", message)
        return error_response(
            422, "invalid_request", _validation_message(errors), field_path(errors[0].get("loc", ()))
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 413: "too_large"}
        return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        if database_unavailable(exc):  # PostgreSQL restarting or failing over: try again shortly
            reason = (str(exc).strip().splitlines() or [""])[0]
            logger.warning("database unavailable on %s %s: %s", request.method, request.url.path, reason)
            response = error_response(
                503, "database_unavailable", "the database cannot be reached right now; retry shortly"
            )
            response.headers["Retry-After"] = str(DATABASE_RETRY_AFTER_S)
            return response
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal server error")


def _snake(name: str) -> str:
    """`ConfigError` → `config` (the code is `invalid_config`)."""
    stem = name.removesuffix("Error")
    return "".join("_" + c.lower() if c.isupper() else c for c in stem).lstrip("_") or "request"


ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "Invalid input; `param` names the field.",
    401: "Missing or unknown API key (or not the admin key where one is needed).",
    403: "A key of the wrong kind: the admin key on a tenant route, or no admin key configured.",
    404: "No such object for this tenant.",
    409: "Not allowed in the object's current state.",
    413: "Request body or upload too large, or the upload would pass the tenant's storage quota.",
    422: "Request does not match the schema; `param` names the field.",
    429: "A limit reached: the key's request rate (with `Retry-After`), or the tenant's unfinished jobs, "
    "files or open event streams.",
    500: "Unexpected server error (logged; no stack trace is returned).",
    503: "The database cannot be reached for now (restarting, failing over); retry after `Retry-After` "
    "seconds. Nothing stored is lost.",
}


def errors(*statuses: int, database: bool = True) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` of a route: the error statuses it can answer, each in the one shape
    (`database`: the route reads the database, so it answers 503 while that is unreachable)."""
    return {
        status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]}
        for status in (*statuses, 500, *((503,) if database else ()))
    }


TENANT = (401, 403, 429)
"""What every tenant route can answer besides its own errors: no key, the admin key, or the key's
request rate exceeded."""


def openapi_with_declared_errors(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI document with only the errors each route declares (`errors(...)`), and
    uploads marked as binary.

    FastAPI adds a 422 `HTTPValidationError` to every route with a parameter, even a plain string path
    parameter that cannot fail, and that shape is not what the handlers here answer; such an added 422
    is dropped, and a declared one keeps `ErrorResponse`.
    """
    if app.openapi_schema is None:
        document = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for path in document["paths"].values():
            for operation in path.values():
                added = operation.get("responses", {}).get("422", {})
                schema = added.get("content", {}).get("application/json", {}).get("schema", {})
                if schema.get("$ref", "").endswith("/HTTPValidationError"):
                    del operation["responses"]["422"]
                # Errors are JSON on every route; FastAPI files them under a text or zip route's own
                # media type.
                for status, response in operation.get("responses", {}).items():
                    content = response.get("content", {})
                    if status.isdigit() and int(status) >= 400 and "application/json" not in content:
                        schemas_by_type = [c.get("schema") for c in content.values() if c.get("schema")]
                        if schemas_by_type:
                            response["content"] = {"application/json": {"schema": schemas_by_type[0]}}
        schemas = document.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        # An upload is `contentMediaType` in OpenAPI 3.1; generators that read 3.0's `format: binary`
        # (openapi-python-client, openapi-generator) would make it a string field otherwise.
        for schema in schemas.values():
            for field in (schema.get("properties") or {}).values():
                if field.get("contentMediaType") == "application/octet-stream":
                    field.setdefault("format", "binary")
        app.openapi_schema = document
    return app.openapi_schema
