"""Routes that take the raw ``Request``: read, refused and documented as FastAPI would have.

The hot room routes skip FastAPI's parameter and dependency solving, which cost about as much CPU
as the rest of a room. They validate with the same models, and a request that breaks them gets the
errors FastAPI would give it: a ``RequestValidationError`` for the app's own handler, or the 400 of
a body that cannot be parsed at all. Their parameters and body are written into the OpenAPI schema
from the same models (``openapi_extra``).
"""

import contextlib
import json
import re
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import parse_qsl

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect

Errors = list[dict[str, Any]]
# One pair with nothing to unquote, as clients send ``?wait=30``: ``parse_qsl`` would give it unchanged.
PLAIN_PAIR = re.compile(rb"(\w+)=([\w.]*)", re.ASCII)
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
    """A query parameter (its last value, if given twice), or ``default`` when it is not there.

    Parsed as ``request.query_params`` parses it, without building that multi-dict per request."""
    raw: bytes = request.scope["query_string"]
    plain = PLAIN_PAIR.fullmatch(raw)
    if plain is not None:
        value = plain[2].decode() if plain[1] == name.encode() else None
    else:
        value = dict(parse_qsl(raw.decode("latin-1"), keep_blank_values=True)).get(name) if raw else None
    return default if value is None else validate(adapter, value, ("query", name), errors)


def header(request: Request, name: bytes) -> str | None:
    """A header's first value, as ``request.headers`` reads it; ``name`` in lower case."""
    for key, value in request.scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _declared_json(request: Request) -> bool:
    kind = (header(request, b"content-type") or "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def _body(request: Request) -> bytes:
    """The whole body, read as ``request.body()`` reads it but without its async generator, which
    costs a request more than the rest of the read."""
    chunks = []
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def json_body(request: Request, adapter: TypeAdapter[Any], errors: Errors) -> Any:
    """The body, parsed when declared JSON (else left as bytes, which a model refuses) and validated.

    A body that pydantic parses and validates in one pass (it takes no JSON that ``json.loads``
    refuses) is taken as it is; any other is parsed and validated again as FastAPI does it, so its
    errors are FastAPI's."""
    try:
        raw = await _body(request)
        declared = bool(raw) and _declared_json(request)
        if declared:
            with contextlib.suppress(ValidationError):
                return adapter.validate_json(raw)
        value = json.loads(raw) if declared else raw
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
