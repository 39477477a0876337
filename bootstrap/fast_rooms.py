"""``POST /rooms`` and ``GET /rooms/{room}``, the routes every client calls per room, answered
without FastAPI's routing, dependency solving and exception wrapping, which cost the bootstrap
about as much CPU as the rest of a room put together.

Only requests that the full route would accept are answered here, with the same body: anything
else (a missing or wrong API key, a query other than ``wait``, a body that does not validate, a
room that is not known) goes on to FastAPI unchanged, which answers with its own errors. A body
that validates but breaks a rule of ``bootstrap.validation``, and errors once a room is placed
(503 and the like), are answered here, in the app's shape.
"""

import json
import re
from urllib.parse import parse_qsl

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bootstrap import api
from bootstrap.cluster import Cluster
from bootstrap.store import StoreUnavailable
from bootstrap.validation import Refused
from shared.wire.security import bearer, secrets_match

PLAIN_NUMBER = re.compile(r"[0-9]{1,6}(\.[0-9]{1,6})?")  # what ?wait= is in practice; else FastAPI parses it


class FastRooms:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if method == "POST" and path == "/rooms":
                await self._post(scope, receive, send)
                return
            digits = path[7:]
            if method == "GET" and path.startswith("/rooms/") and digits.isascii() and digits.isdigit():
                await self._get(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _usable(scope: Scope) -> tuple[Cluster, float] | None:
        """The cluster and the ``wait`` asked for, if the full route would accept both."""
        cluster: Cluster = scope["app"].state.cluster
        if cluster.api_key is not None:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
            if not secrets_match(bearer(given or None), cluster.api_key):
                return None
        query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
        if len(query) > 1 or any(key != "wait" or not PLAIN_NUMBER.fullmatch(v) for key, v in query):
            return None
        wait = float(query[0][1]) if query else 0.0
        if wait > cluster.settings.max_wait_s:
            return None
        return cluster, wait

    @staticmethod
    def _json(scope: Scope) -> bool:
        """Whether the body is declared JSON, as FastAPI requires before it parses one."""
        declared = next((v for k, v in scope["headers"] if k == b"content-type"), b"").decode("latin-1")
        kind = declared.split(";")[0].strip().lower()
        return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))

    async def _post(self, scope: Scope, receive: Receive, send: Send) -> None:
        usable = self._usable(scope)
        if usable is None or not self._json(scope):
            await self.app(scope, receive, send)
            return
        cluster, wait = usable
        messages, body = await _read(receive)
        if messages[-1]["type"] == "http.disconnect":
            return  # the client is gone, or the body was refused as too large: nothing to place
        try:
            # Parsed as FastAPI parses a body, then validated as it validates one.
            request = api.RoomRequest.model_validate(json.loads(body))
        except (ValueError, ValidationError, RecursionError):  # JSONDecodeError is a ValueError
            await self.app(scope, _replay(messages, receive), send)  # FastAPI names what is wrong
            return
        try:
            tokens = request.tokens(cluster)
        except Refused as exc:
            await JSONResponse({"detail": exc.message}, 422)(scope, receive, send)  # as the app answers it
            return
        try:
            room = await api.place(cluster, tokens, request.max_new_tokens, [], False)
            response = await api.room_response(cluster, await api.wait_finished(cluster, room, wait), 201)
        except (HTTPException, StoreUnavailable) as exc:
            response = _error(exc)
        await response(scope, receive, send)

    async def _get(self, scope: Scope, receive: Receive, send: Send) -> None:
        usable = self._usable(scope)
        digits = scope["path"][7:]
        if usable is None or len(digits) > 19 or int(digits) >= 1 << 63:
            await self.app(scope, receive, send)
            return
        cluster, wait = usable
        try:
            found = await cluster.store.room(int(digits))
            if found is None:
                await self.app(scope, receive, send)  # its 404
                return
            response = await api.room_response(cluster, await api.wait_finished(cluster, found, wait))
        except StoreUnavailable as exc:
            response = _error(exc)
        await response(scope, receive, send)


async def _read(receive: Receive) -> tuple[list[Message], bytes]:
    messages = []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request" or not message.get("more_body", False):
            break
    return messages, b"".join(m.get("body", b"") for m in messages)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """The body already read, then whatever the server sends next."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def _error(exc: HTTPException | StoreUnavailable) -> JSONResponse:
    """As the app's handlers answer it."""
    http = api.unavailable(exc) if isinstance(exc, StoreUnavailable) else exc
    return JSONResponse({"detail": http.detail}, http.status_code, headers=http.headers)
