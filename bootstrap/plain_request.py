"""Routes that take the raw ``Request``: read, refused and documented as FastAPI would have.

The hot room routes skip FastAPI's parameter and dependency solving, which cost about as much CPU
as the rest of a room. They validate with the same models, and a request that breaks them gets the
errors FastAPI would give it: a ``RequestValidationError`` for the app's own handler, or the 400 of
a body that cannot be parsed at all. Their parameters and body are written into the OpenAPI schema
from the same models (``openapi_extra``).
"""

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect

Errors = list[dict[str, Any]]
# The 422 FastAPI documents for a route whose parameters it checks.
VALIDATION_ERROR: dict[int | str, dict[str, Any]] = {
    422: {
        "description": "Validation Error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}},
    }
}


class PlainRoute(APIRoute):
    """A route whose endpoint takes the ``Request`` and returns its ``Response``: FastAPI documents it
    (from its ``openapi_extra``) and handles its exceptions, but solves nothing for it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        endpoint: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
        return endpoint


def validate(adapter: TypeAdapter[Any], value: Any, loc: tuple[str, ...], errors: Errors) -> Any:
    """``value`` as ``adapter`` takes it; else None, and its problems, each under ``loc``, join ``errors``."""
    try:
        return adapter.validate_python(value, from_attributes=True)
    except ValidationError as exc:
        errors.extend({**e, "loc": (*loc, *e["loc"])} for e in exc.errors(include_url=False))
        return None


def query(request: Request, name: str, adapter: TypeAdapter[Any], default: Any, errors: Errors) -> Any:
    """A query parameter (its last value, if given twice), or ``default`` when it is not there."""
    value = request.query_params.get(name)
    return default if value is None else validate(adapter, value, ("query", name), errors)


def _declared_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def json_body(request: Request, adapter: TypeAdapter[Any], errors: Errors) -> Any:
    """The body, parsed when declared JSON (else left as bytes, which a model refuses) and validated."""
    try:
        raw = await request.body()
        value = json.loads(raw) if raw and _declared_json(request) else raw
    except json.JSONDecodeError as exc:
        error = {"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error", "input": {}}
        raise RequestValidationError([{**error, "ctx": {"error": exc.msg}}], body=exc.doc) from exc
    except (ValueError, RecursionError, ClientDisconnect) as exc:  # not Unicode, nested too deep, gone
        raise HTTPException(400, "There was an error parsing the body") from exc
    if not raw:
        errors.append({"type": "missing", "loc": ("body",), "msg": "Field required", "input": None})
        return None
    return validate(adapter, value, ("body",), errors)


def parameter(
    name: str, where: str, adapter: TypeAdapter[Any], default: Any = None, description: str | None = None
) -> dict[str, Any]:
    """A parameter's OpenAPI entry, as FastAPI writes it; one with no default is required."""
    schema = {**adapter.json_schema(), "title": name.replace("_", " ").title()}
    entry = {"name": name, "in": where, "required": default is None, "schema": schema}
    if default is not None:
        schema["default"] = default
    if description is not None:
        schema["description"] = entry["description"] = description
    return entry


def json_body_entry(adapter: TypeAdapter[Any]) -> dict[str, Any]:
    """A required JSON body's OpenAPI entry."""
    return {"required": True, "content": {"application/json": {"schema": adapter.json_schema()}}}
