"""An OpenAI-compatible front on the bootstrap: /v1/models, /v1/completions, /v1/chat/completions.

Each request is one room. Decoding is greedy (temperature and top_p are
accepted and have no effect). With ``stream: true`` tokens go out as server-sent
events as the decode node streams them; a room's first token is only ever
decoded after its SUCCESS. Errors come in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.
"""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from bootstrap.api import ClusterDep, api_key_checked, place
from bootstrap.rooms import RoomRecord
from bootstrap.tokenizer import TokenizerError

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

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


async def openai_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return exc.response()


Stop = str | Annotated[list[str], Field(max_length=4)] | None


class Options(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take. Unknown fields are refused, as OpenAI refuses them."""

    model_config = ConfigDict(extra="forbid")

    model: str
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
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    max_tokens: int = Field(16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


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


async def _finished(cluster: Any, record: RoomRecord) -> None:
    try:
        await asyncio.wait_for(record.done.wait(), cluster.settings.request_timeout_s)
    except TimeoutError as exc:
        raise OpenAIError(504, f"room {record.id} did not finish in time", "server_error") from exc
    view = record.view()
    if view["state"] == "FAILED":
        raise OpenAIError(
            502, f"room {record.id} failed: {record.reason}", "server_error", code=record.reason
        )


def _usage(record: RoomRecord) -> dict[str, int]:
    out = len(record.output_ids or record.streamed)
    return {
        "prompt_tokens": len(record.input_ids),
        "completion_tokens": out,
        "total_tokens": len(record.input_ids) + out,
    }


def _place(cluster: Any, ids: list[int], max_tokens: int, body: Sampling) -> RoomRecord:
    if any(t >= cluster.tokenizer.vocab_size for t in ids):
        raise OpenAIError(400, "a token id is outside the vocabulary", param="prompt")
    try:
        return place(cluster, ids, max_tokens, body.stops(), body.stream)
    except Exception as exc:
        status = getattr(exc, "status_code", 500)
        raise OpenAIError(
            status,
            str(getattr(exc, "detail", exc)),
            "server_error" if status >= 500 else "invalid_request_error",
        ) from exc


class _Streamer:
    """Decoded text as it grows, released only where no later token or stop string can change it."""

    def __init__(self, cluster: Any, record: RoomRecord, stops: list[str]):
        self._decode = cluster.tokenizer.decode
        self._record = record
        self._stops = stops
        self._sent = 0

    def delta(self, final: bool) -> str:
        text = self._decode(
            self._record.output_ids
            if final and self._record.output_ids is not None
            else self._record.streamed
        )
        cut = _cut(text, self._stops)
        if not final:
            if cut != text:  # a stop string appeared: nothing after it ever goes out
                final = True
            held = max((len(s) - 1 for s in self._stops), default=0)
            safe = len(cut) - held
            while safe > 0 and cut[safe - 1] == "\ufffd":  # a character still being spelled out
                safe -= 1
            cut = cut[: max(safe, self._sent)]
        out, self._sent = cut[self._sent :], max(self._sent, len(cut))
        return out


async def _events(
    cluster: Any, record: RoomRecord, stops: list[str], chunk: Any, usage: bool
) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + msgspec.json.encode(payload) + b"\n\n"

    streamer = _Streamer(cluster, record, stops)
    deadline = time.monotonic() + cluster.settings.request_timeout_s
    yield event(chunk("", None, first=True))
    while not record.done.is_set():
        record.progress.clear()
        text = streamer.delta(final=False)
        if text:
            yield event(chunk(text, None))
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            await asyncio.wait_for(record.progress.wait(), left)
        except TimeoutError:
            break
    view = record.view()
    if view["state"] == "FAILED" or not record.done.is_set():
        error = {
            "message": f"room {record.id} failed: {record.reason or 'timeout'}",
            "type": "server_error",
            "param": None,
            "code": record.reason,
        }
        yield event({"error": error})
    else:
        text = streamer.delta(final=True)
        if text:
            yield event(chunk(text, None))
        yield event(chunk("", record.finish_reason or "length"))
        if usage:
            yield event({**chunk("", None), "choices": [], "usage": _usage(record)})
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
async def completions(body: CompletionRequest, cluster: ClusterDep) -> Response:
    _check_model(cluster, body.model)
    ids = cluster.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else body.prompt
    record = _place(cluster, ids, body.max_tokens, body)
    created, rid = int(time.time()), f"cmpl-{record.id}"

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
        return _stream(_events(cluster, record, body.stops(), chunk, usage))
    await _finished(cluster, record)
    text = _cut(cluster.tokenizer.decode(record.output_ids or []), body.stops())
    answer = chunk(text, record.finish_reason or "length")
    return JSONResponse({**answer, "usage": _usage(record)})


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatRequest, cluster: ClusterDep) -> Response:
    _check_model(cluster, body.model)
    try:
        ids = cluster.tokenizer.chat([m.model_dump() for m in body.messages])
    except TokenizerError as exc:
        raise OpenAIError(400, str(exc), param="messages") from exc
    record = _place(cluster, ids, body.max_completion_tokens or body.max_tokens or 16, body)
    created, rid = int(time.time()), f"chatcmpl-{record.id}"

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
        return _stream(_events(cluster, record, body.stops(), chunk, usage))
    await _finished(cluster, record)
    text = _cut(cluster.tokenizer.decode(record.output_ids or []), body.stops())
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
                    "finish_reason": record.finish_reason or "length",
                    "logprobs": None,
                }
            ],
            "usage": _usage(record),
        }
    )
