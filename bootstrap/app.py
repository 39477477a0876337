"""The bootstrap FastAPI application and its lifespan."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bootstrap import api, openai_api, status_page
from bootstrap.cluster import Cluster
from bootstrap.hot_routes import HotRoutes
from bootstrap.openai_api import OpenAIError, openai_error
from bootstrap.settings import BootstrapSettings
from bootstrap.store import StoreUnavailable
from bootstrap.validation import Refused
from shared.heap import freeze_startup_heap
from shared.metrics import NO_OPENTELEMETRY

log = logging.getLogger(__name__)


class BodyLimit:
    """Refuse request bodies above ``limit`` bytes before reading them whole."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for key, value in scope["headers"]:  # a loop: a generator costs a request more
            if key == b"content-length":
                declared = value
                break
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await self._refuse(scope, send)
                return
            # The server never delivers more than the declared length.
            await self.app(scope, receive, send)
            return
        seen = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal seen, refused
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit and not refused:
                # Answer now and tell the app the client is gone; it stops reading.
                refused = True
                await self._refuse(scope, send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        message = "request body too large"
        body = msgspec.json.encode(
            OpenAIError(413, message).body() if _openai(scope["path"]) else {"detail": message}
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _printable(value: Any) -> Any:
    """A value that JSON can carry: text that is not valid Unicode is escaped."""
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, (int, float)) or value is None:
        return value
    return _printable(str(value))


def _openai(path: str) -> bool:
    return path.startswith("/v1/")


def _param(loc: list[Any], body: Any) -> str | None:
    """The part of ``loc`` that is a path in the body, as OpenAI names a parameter ("messages.0.content");
    the rest names a member of a type union."""
    path = []
    for part in loc:
        if (isinstance(body, dict) and part in body) or (isinstance(body, list) and isinstance(part, int)):
            path.append(str(part))
            body = body[part]
        else:
            break
    return ".".join(path) or None


async def invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """422 with what was wrong and where, never the input itself: it may not even be encodable.

    Under /v1 the OpenAI shape: 400 with the first problem and the parameter it concerns.
    """
    assert isinstance(exc, RequestValidationError)
    detail = [
        {
            "loc": [_printable(part) for part in error["loc"]],
            "msg": _printable(error["msg"]),
            "type": error["type"],
        }
        for error in exc.errors()
    ]
    if _openai(request.url.path):
        first = detail[0] if detail else {"loc": [], "msg": "invalid request", "type": ""}
        if first["type"] == "json_invalid":  # its loc is a character position, not a parameter
            return OpenAIError(400, f"the body is not valid JSON: {first['msg']}").response()
        param = _param(list(first["loc"])[1:], exc.body)
        return OpenAIError(400, f"{param or 'body'}: {first['msg']}", param=param).response()
    return JSONResponse({"detail": detail}, status_code=422)


async def refused(request: Request, exc: Exception) -> JSONResponse:
    """A request no node could serve as it is: 422 naming why, or OpenAI's 400 under /v1."""
    assert isinstance(exc, Refused)
    if _openai(request.url.path):
        return OpenAIError(400, exc.message, param=exc.param).response()
    return JSONResponse({"detail": exc.message}, status_code=422)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own shape, or OpenAI's under /v1."""
    assert isinstance(exc, StarletteHTTPException)
    if _openai(request.url.path):
        code = "invalid_api_key" if exc.status_code == 401 else None
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind, code=code).response()
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


async def server_error(request: Request, exc: Exception) -> JSONResponse:
    """A fault of the bootstrap's own (logged with its traceback by the server), in the route's shape."""
    if _openai(request.url.path):
        return OpenAIError(500, "internal error", "server_error").response()
    return JSONResponse({"detail": "internal error"}, status_code=500)


async def store_unavailable(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StoreUnavailable)
    return await http_error(request, api.unavailable(exc))


def warn_if_open(settings: BootstrapSettings, join_token: str | None) -> None:
    if settings.host in ("0.0.0.0", "::") and join_token is None:
        log.warning(
            "listening on all interfaces with no join token: any host that reaches port %d can join "
            "this cluster as a node; set KVROOM_JOIN_TOKEN",
            settings.http_port,
        )


def create_app(settings: BootstrapSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cluster = Cluster(settings)
        app.state.cluster = cluster
        warn_if_open(settings, cluster.join_token)
        await cluster.start()
        ready = asyncio.Event()
        tasks = [
            asyncio.create_task(cluster.receive_reports(ready)),
            asyncio.create_task(cluster.watch()),
        ]
        await ready.wait()
        freeze_startup_heap()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await cluster.close()

    app = FastAPI(
        title="kvroom bootstrap",
        description="Registers prefill and decode nodes and hands out rooms.",
        lifespan=lifespan,
        telemetry=NO_OPENTELEMETRY,
        # Documented and routed by the app too; HotRoutes answers them first.
        routes=api.hot_rooms.routes,
    )
    app.add_middleware(HotRoutes, routes=api.hot_rooms.routes, handlers=app.exception_handlers)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # added last: it runs first
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StoreUnavailable, store_unavailable)
    app.add_exception_handler(Refused, refused)
    app.add_exception_handler(Exception, server_error)
    app.include_router(api.nodes)
    app.include_router(api.nodes_open)
    app.include_router(openai_api.router)
    app.include_router(api.rooms_router)
    app.include_router(api.ops)
    app.include_router(status_page.router)
    return app
