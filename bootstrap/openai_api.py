"""An OpenAI-compatible front on the bootstrap: /v1/models, /v1/completions, /v1/chat/completions.

Each request is one room. Decoding is greedy (temperature and top_p are
accepted and have no effect). With ``stream: true`` tokens go out as server-sent
events as the decode node streams them; a room's first token is only ever
decoded after its SUCCESS. Errors come in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from bootstrap.api import ClusterDep, api_key_checked, place
from bootstrap.store import RoomData
from bootstrap.validation import PromptText, Refused, Stop, Text, check_room, encode
from shared.wire.protocol import RoomId

router = APIRouter(prefix="/v1", tags=["openai"], dependencies=[Depends(api_key_checked)])


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


async def openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


class Options(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take. Unknown fields are refused, as OpenAI refuses them, and so
    are values of another type (a number sent as a string)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Text
    stream: bool = False
    stream_options: Options | None = None
    stop: Stop = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: Literal[1] = 1
    seed: int | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(Sampling):
    prompt: PromptText | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: int = Field(16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _check_model(cluster: Any, name: str) -> None:
    if name != cluster.tokenizer.name:
        raise OpenAIError(404, f"The model `{name}` does not exist", param="model", code="model_not_found")


def _cut(text: str, stops: list[str]) -> str:
    """The text before the first stop string, which OpenAI leaves out."""
    at = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
    return text[:at]


async def _finished(request: Request, cluster: Any, room: RoomData) -> RoomData:
    """The room's end. A client that leaves before it ends the room on both nodes now, as vLLM
    aborts a request whose client left (a stream's end does the same, in ``_events``)."""
    ended = asyncio.ensure_future(
        cluster.wait(room.room, cluster.settings.request_timeout_s, lambda r: r.done)
    )
    left = asyncio.ensure_future(_client_left(request))
    try:
        await asyncio.wait({ended, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # both, also when this handler is cancelled
        gone = not ended.done()
        ended.cancel()
        left.cancel()
    if gone:
        cluster.abort_soon(room.room)
        raise OpenAIError(499, "the client closed its connection", "invalid_request_error")
    done: RoomData | None = ended.result()
    if done is None or not done.done:
        raise OpenAIError(504, f"room {room.room} did not finish in time", "server_error")
    if done.failed:
        raise OpenAIError(502, f"room {room.room} failed: {done.reason}", "server_error", code=done.reason)
    return done


async def _client_left(request: Request) -> None:
    """Returns once the client closed its connection (its body is read: nothing else comes)."""
    with contextlib.suppress(Exception):  # a receive that fails: the client is gone as well
        while (await request.receive())["type"] != "http.disconnect":
            pass


def _usage(room: RoomData, streamed: list[int]) -> dict[str, int]:
    out = len(room.output_ids if room.output_ids is not None else streamed)
    prompt = len(room.input_ids)
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}


async def _place(
    cluster: Any, ids: list[int], max_tokens: int, body: Sampling, params: tuple[str, str]
) -> RoomData:
    check_room(cluster.tokenizer, cluster.settings, ids, max_tokens, *params)
    try:
        room: RoomData = await place(cluster, ids, max_tokens, body.stops(), body.stream)
        return room
    except HTTPException as exc:
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        raise OpenAIError(exc.status_code, str(exc.detail), kind) from exc


class _Streamer:
    """Decoded text as it grows, released only where no later token or stop string can change it."""

    def __init__(self, cluster: Any, stops: list[str]):
        self._decode = cluster.tokenizer.decode
        self._stops = stops
        self._sent = 0

    def delta(self, tokens: list[int], final: bool) -> str:
        text = self._decode(tokens)
        cut = _cut(text, self._stops)
        if not final and cut == text:
            held = max((len(s) - 1 for s in self._stops), default=0)  # a stop string may be starting
            safe = len(cut) - held
            while safe > 0 and cut[safe - 1] == "\ufffd":  # a character still being spelled out
                safe -= 1
            cut = cut[: max(safe, self._sent)]
        out, self._sent = cut[self._sent :], max(self._sent, len(cut))
        return out


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def _events(
    cluster: Any, room_id: RoomId, stops: list[str], chunk: Callable[..., dict[str, Any]], usage: bool
) -> AsyncIterator[bytes]:
    streamer = _Streamer(cluster, stops)
    deadline = time.monotonic() + cluster.settings.request_timeout_s
    ended = False
    try:
        yield _sse(chunk("", None, first=True))
        async for payload in _room_events(cluster, room_id, streamer, chunk, usage, deadline):
            yield payload
        ended = True
    finally:
        if not ended:  # the client left mid-stream: its room, on both nodes, ends now
            cluster.abort_soon(room_id)


async def _room_events(
    cluster: Any,
    room_id: RoomId,
    streamer: "_Streamer",
    chunk: Callable[..., dict[str, Any]],
    usage: bool,
    deadline: float,
) -> AsyncIterator[bytes]:
    async with cluster.watching(room_id) as changed:
        while True:
            changed.clear()
            room = await cluster.store.room(room_id)
            streamed = await cluster.store.tokens(room_id)
            if room is None or room.done:
                break
            text = streamer.delta(streamed, final=False)
            if text:
                yield _sse(chunk(text, None))
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)
    if room is None or not room.done or room.failed:
        reason = room.reason if room is not None else "unknown"
        error = {
            "message": f"room {room_id} failed: {reason or 'timeout'}",
            "type": "server_error",
            "param": None,
            "code": reason,
        }
        yield _sse({"error": error})
    else:
        text = streamer.delta(room.output_ids if room.output_ids is not None else streamed, final=True)
        if text:
            yield _sse(chunk(text, None))
        yield _sse(chunk("", room.finish_reason or "length"))
        if usage:
            yield _sse({**chunk("", None), "choices": [], "usage": _usage(room, streamed)})
    yield b"data: [DONE]\n\n"


def _stream(events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/models")
async def list_models(cluster: ClusterDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": cluster.tokenizer.name,
                "object": "model",
                "created": cluster.started,
                "owned_by": "kvroom",
            }
        ],
    }


@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request, cluster: ClusterDep) -> Response:
    _check_model(cluster, body.model)
    ids = encode(cluster.tokenizer, body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
    room = await _place(cluster, ids, body.max_tokens, body, ("prompt", "max_tokens"))
    created, rid = int(time.time()), f"cmpl-{room.room}"

    def chunk(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        }

    usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return _stream(_events(cluster, room.room, body.stops(), chunk, usage))
    room = await _finished(request, cluster, room)
    text = _cut(cluster.tokenizer.decode(room.output_ids or []), body.stops())
    answer = chunk(text, room.finish_reason or "length")
    return JSONResponse({**answer, "usage": _usage(room, [])})


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, request: Request, cluster: ClusterDep) -> Response:
    _check_model(cluster, body.model)
    try:
        ids = cluster.tokenizer.chat([m.model_dump() for m in body.messages])
    except (ValueError, TypeError) as exc:  # TokenizerError is a ValueError
        raise Refused(f"messages: {exc}", "messages") from exc
    limit = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens or 16
    room = await _place(cluster, ids, max_tokens, body, ("messages", limit))
    created, rid = int(time.time()), f"chatcmpl-{room.room}"

    def chunk(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish is not None:
            delta = {}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }

    usage = bool(body.stream_options and body.stream_options.include_usage)
    if body.stream:
        return _stream(_events(cluster, room.room, body.stops(), chunk, usage))
    room = await _finished(request, cluster, room)
    text = _cut(cluster.tokenizer.decode(room.output_ids or []), body.stops())
    return JSONResponse(
        {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": room.finish_reason or "length",
                    "logprobs": None,
                }
            ],
            "usage": _usage(room, []),
        }
    )
