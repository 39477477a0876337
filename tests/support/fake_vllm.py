"""A stand-in for vLLM's OpenAI server (0.32) as kvroom's bootstrap drives it: a real HTTP server on
127.0.0.1 that records each request and answers it, or streams it as server-sent events, as vLLM
does. It tests the bootstrap's side only; it proves nothing about vLLM itself.

Several nodes share one server, each under its own path: ``url("p0")`` is node p0's ``http_url``
(its requests come to ``/p0/v1/completions``). What a node does with a request is ``behaviour``:

- ``answer`` (the default): the prefill answers at once; the decode streams ``tokens``, one an
  event, the last with its finish reason, then ``[DONE]``.
- ``hold``: the request stops at a gate until ``release`` is called (or the client leaves): the
  prefill before its answer, the decode (its headers sent) before each token's event.
- ``error``: HTTP 500, as vLLM answers a request it failed.
- ``cut``: the decode's stream breaks after its first token (the connection closes mid-body).
"""

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from tests.support.waiting import until


@dataclass
class Got:
    """One request as the server got it."""

    node: str
    body: dict[str, Any]
    at: float = field(default_factory=time.monotonic)
    answered: bool = False
    gates: int = 0  # gates of a ``hold`` reached
    disconnected: bool = False  # the client left before the answer was complete


class FakeVllm:
    def __init__(self, tokens: list[int] | None = None):
        self.tokens = tokens or [72, 105, 33, 10]
        self.behaviour: dict[str, str] = {}
        self.requests: list[Got] = []
        self._released: dict[str, asyncio.Event] = {}
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        config = uvicorn.Config(
            self._app, interface="asgi3", log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    def __enter__(self) -> "FakeVllm":
        self._thread.start()
        until(lambda: self._server.started, 10, "the fake vLLM server to start")
        return self

    def __exit__(self, *exc: object) -> None:
        for node in list(self._released):
            self.release(node)
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.port}/{node}"

    def got(self, node: str) -> list[Got]:
        return [r for r in self.requests if r.node == node]

    def release(self, node: str) -> None:
        """A node that holds its answers gives them."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._event(node).set)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._server.serve(sockets=[self._sock])

    def _event(self, node: str) -> asyncio.Event:
        return self._released.setdefault(node, asyncio.Event())

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        node, _, path = scope["path"].lstrip("/").partition("/")
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if path != "v1/completions" or scope["method"] != "POST":
            await _json(send, 404, {"error": {"message": "not found"}})
            return
        got = Got(node, json.loads(body))
        self.requests.append(got)
        gone = asyncio.Event()
        watcher = asyncio.ensure_future(_watch(receive, got, gone))
        try:
            await self._answer(got, send, gone)
        finally:
            watcher.cancel()

    async def _answer(self, got: Got, send: Any, gone: asyncio.Event) -> None:
        behaviour = self.behaviour.get(got.node, "answer")
        if behaviour == "error":
            got.answered = True
            await _json(send, 500, {"error": {"message": "engine failed", "type": "InternalServerError"}})
            return
        if not got.body.get("stream"):
            if behaviour == "hold" and not await self._gate(got, gone):
                return
            got.answered = True
            await _json(send, 200, completion(got.body, self.tokens[:1], "length"))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        tokens = self.tokens[: got.body["max_tokens"]]
        finish = "length" if len(tokens) == got.body["max_tokens"] else "stop"
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            if behaviour == "hold" and not await self._gate(got, gone):
                return
            event = completion(got.body, [token], finish if last else None, first=i == 0)
            await send({"type": "http.response.body", "body": _sse(event), "more_body": True})
            if behaviour == "cut":
                raise ConnectionError("the fake decode breaks its stream")
        got.answered = True
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _gate(self, got: Got, gone: asyncio.Event) -> bool:
        """True once the node is released (each release opens one gate), False if the client left."""
        got.gates += 1
        event = self._event(got.node)
        released = asyncio.ensure_future(event.wait())
        left = asyncio.ensure_future(gone.wait())
        await asyncio.wait({released, left}, return_when=asyncio.FIRST_COMPLETED)
        released.cancel()
        left.cancel()
        if gone.is_set():
            return False
        event.clear()
        return True


def completion(request: dict[str, Any], tokens: list[int], finish: str | None, first: bool = False) -> dict:
    """One completion (or one streamed chunk of it) as vLLM 0.32 sends it with return_token_ids."""
    streaming = bool(request.get("stream"))
    prompt_ids = request["prompt"] if first or not streaming else None
    choice = {
        "index": 0,
        "text": "".join(chr(t) for t in tokens),
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": prompt_ids if request.get("return_token_ids") else None,
        "token_ids": tokens if request.get("return_token_ids") else None,
    }
    answer = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "created": int(time.time()),
        "model": request["model"],
        "choices": [choice],
    }
    if not streaming:
        answer["usage"] = {"prompt_tokens": len(request["prompt"]), "completion_tokens": len(tokens)}
        answer["kv_transfer_params"] = None
    return answer


async def _watch(receive: Any, got: Got, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    if not got.answered:
        got.disconnected = True
    gone.set()


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _json(send: Any, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
