"""The routes every client calls per room, answered ahead of FastAPI's exception and routing layers.

Those layers (the exception middleware, the per-request exit stacks, the walk over every route and
the route's own wrappers) cost a room about a quarter of its CPU. ``HotRoutes`` sits inside the
server-error and body-limit middleware; a request that one of the given routes matches in full it
answers by calling that route's own endpoint, and an exception from it by the app's own handler for
it, as FastAPI would have. Anything else goes on to the app unchanged; the routes stay in the app
too, which documents them.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request, Exception], Any]  # each of the app's handlers is a coroutine


class HotRoutes:
    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute], handlers: Mapping[Any, Handler]):
        self.app = app
        self.routes = [route for route in routes if isinstance(route, APIRoute)]
        assert len(self.routes) == len(routes), "only FastAPI routes"
        # The app's own dict, read per exception: handlers added after this still count.
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Under a root path the app routes everything itself.
        if scope["type"] == "http" and not scope.get("root_path"):
            method, path = scope["method"], scope["path"]
            for route in self.routes:
                # What the route's own matches() checks for a full match (a partial one, a method it
                # does not take, goes on to the app, which answers 405 or finds another route).
                found = route.path_regex.match(path) if method in (route.methods or ()) else None
                if found is not None:
                    convert = route.param_convertors
                    scope["path_params"] = {k: convert[k].convert(v) for k, v in found.groupdict().items()}
                    await self._answer(route, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _answer(self, route: APIRoute, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        try:
            response: Response = await route.endpoint(request)
        except Exception as exc:
            handler = self._handler(exc)
            if handler is None:
                raise  # the server-error middleware answers it, as for every route
            response = await handler(request, exc)
        await response(scope, receive, send)

    def _handler(self, exc: Exception) -> Handler | None:
        """The handler the exception middleware would pick: by status code, then the nearest class.
        ``Exception`` itself is left to the server-error middleware, as FastAPI leaves it."""
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls is Exception:
                return None
            if cls in self.handlers:
                return self.handlers[cls]
        return None
