"""The API server's check of transfer parameters, as ASGI middleware for ``vllm serve``.

``--middleware kvroom_vllm.guard.TransferParamsGuard`` answers a request that names a kvroom
transfer (``kv_transfer_params.kvroom``) 403 with the reason, before vLLM reads it, unless the
cluster's bootstrap signed it for this server (``shared.wire.grants``): not run, and not run as a
plain request. The key comes from the bootstrap (``GET /params-key`` with the join token) and is
asked again when a grant does not check out with the one held, at most once a second.

The engine's scheduler half checks every request again and fails one that is refused there (a
request that reached the engine some other way): this check is the one that answers the client
with a 4xx and a reason.
"""

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from kvroom_vllm.messages import room_params
from kvroom_vllm.settings import VllmNodeSettings, settings_from
from shared.wire import grants
from shared.wire.registration import ParamsKey

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_RETRY_S = 1.0  # a grant that fails to check asks the bootstrap for its key at most this often
KEY_TIMEOUT_S = 5.0


class Refused(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class TransferParamsGuard:
    def __init__(self, app: ASGIApp):
        self.app = app
        self._settings: VllmNodeSettings | None = None
        self._role = ""
        self._key: bytes | None = None
        self._asked_at = 0.0
        self._first_use = grants.FirstUse()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await _body(receive)
        if body is None:
            return  # the client left before its body was in
        try:
            await self._check(scope, body)
        except Refused as exc:
            log.warning("%s %s refused: %s", scope["method"], scope.get("path"), exc.reason)
            await _error(send, exc.status, exc.reason)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _check(self, scope: Scope, body: bytes) -> None:
        if b"kv_transfer_params" not in body and b"\\u" not in body:
            return  # no key of it can be kv_transfer_params (one spelt with escapes has a \u)
        try:
            request = json.loads(body)
        except ValueError:
            return  # vLLM answers a body that is not JSON itself
        if not isinstance(request, dict):
            return
        xargs = request.get("vllm_xargs")
        if isinstance(xargs, dict) and "kv_transfer_params" in xargs:
            raise Refused(400, "kv_transfer_params go at the top of the request, not in vllm_xargs")
        try:
            grant = room_params(request.get("kv_transfer_params"))
        except ValueError as exc:
            raise Refused(400, f"kv_transfer_params.kvroom is not a transfer grant: {exc}") from None
        if grant is None:
            return
        prompt = request.get("prompt")
        tokens = prompt if isinstance(prompt, list) and all(type(t) is int for t in prompt) else None
        now, key = time.time(), await self._key_for(scope)  # the key first: it reads the role too
        why = grants.refusal(grant, key, self._role, tokens, now=now)
        if why is not None and time.monotonic() - self._asked_at > KEY_RETRY_S:
            # The bootstrap may have a new key (a restarted cluster with a store of its own).
            why = grants.refusal(grant, await self._key_for(scope, renew=True), self._role, tokens, now=now)
        if why is None and not self._first_use.take(grant, uuid.uuid4().hex, now):
            why = f"transfer {grant.transfer} was already taken by another request"
        if why is not None:
            raise Refused(403, why)

    async def _key_for(self, scope: Scope, renew: bool = False) -> bytes:
        if self._settings is None:
            config = scope["app"].state.vllm_config.kv_transfer_config
            self._settings = settings_from(dict(config.kv_connector_extra_config or {}))
            self._role = "prefill" if config.kv_role == "kv_producer" else "decode"
        if self._key is None or renew:
            self._asked_at = time.monotonic()
            token = self._settings.resolved_join_token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            try:
                async with httpx.AsyncClient(timeout=KEY_TIMEOUT_S, trust_env=False) as client:
                    resp = await client.get(
                        f"{self._settings.bootstrap_url.rstrip('/')}/params-key", headers=headers
                    )
                resp.raise_for_status()
                self._key = bytes.fromhex(ParamsKey.model_validate(resp.json()).params_key)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("could not ask the bootstrap for its key: %s", exc)
                if self._key is None:  # the client hears no more: the bootstrap's address is internal
                    raise Refused(503, "cannot check transfer parameters: no key from the bootstrap") from exc
        return self._key


async def _body(receive: Receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The request's body once more for vLLM, then the client's later messages (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _error(send: Send, status: int, reason: str) -> None:
    """vLLM's own error shape."""
    kind = {400: "BadRequestError", 403: "PermissionDeniedError"}.get(status, "ServiceUnavailableError")
    payload = json.dumps(
        {"error": {"message": reason, "type": kind, "param": "kv_transfer_params", "code": status}}
    )
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload.encode()})
