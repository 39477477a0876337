"""The bootstrap FastAPI application and its lifespan."""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bootstrap import api, openai_api, status_page
from bootstrap.cluster import Cluster
from bootstrap.fast_rooms import FastRooms
from bootstrap.openai_api import OpenAIError, openai_error
from bootstrap.settings import BootstrapSettings
from bootstrap.store import StoreUnavailable
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
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None:
            if not declared.isdigit() or int(declared) > self.limit:
                await self._refuse(send)
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
                await self._refuse(send)
                return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Send) -> None:
        body = b'{"detail":"request body too large"}'
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
    if request.url.path.startswith("/v1/"):
        first = detail[0] if detail else {"loc": [], "msg": "invalid request"}
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        return OpenAIError(400, f"{param or 'body'}: {first['msg']}", param=param).response()
    return JSONResponse({"detail": detail}, status_code=422)


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own shape, or OpenAI's under /v1."""
    assert isinstance(exc, StarletteHTTPException)
    if request.url.path.startswith("/v1/"):
        code = "invalid_api_key" if exc.status_code == 401 else None
        return OpenAIError(exc.status_code, str(exc.detail), code=code).response()
    return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)


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
    )
    app.add_middleware(FastRooms)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)  # added last: it runs first
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(OpenAIError, openai_error)
    app.add_exception_handler(StoreUnavailable, store_unavailable)
    app.include_router(api.nodes)
    app.include_router(api.nodes_open)
    app.include_router(openai_api.router)
    app.include_router(api.rooms_router)
    app.include_router(api.ops)
    app.include_router(status_page.router)
    return app
