"""The bootstrap's REST API: thin routers over the Cluster.

Node routes need the join secret, client routes the API key when one is set
(both as ``Authorization: Bearer``); health, metrics and the status page stay
open.
"""

from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

from bootstrap import rooms
from bootstrap.cluster import Cluster
from bootstrap.placement import NeverFits, NoCapacity, NoLiveNode
from bootstrap.plain_request import (
    VALIDATION_ERROR,
    Errors,
    PlainRoute,
    header,
    json_body,
    json_body_entry,
    parameter,
    query,
    validate,
)
from bootstrap.registry import Incompatible, Node
from bootstrap.store import RoomData, StoreUnavailable
from bootstrap.validation import PromptText, check_room, encode
from shared.metrics import CONTENT_TYPE_LATEST
from shared.wire.protocol import RoomId
from shared.wire.registration import Heartbeat, LeaveCause, NodeRegistration, ParamsKey
from shared.wire.security import bearer, secrets_match


async def get_cluster(request: Request) -> Cluster:
    """A coroutine: FastAPI would run a plain function in a thread pool, per request."""
    cluster: Cluster = request.app.state.cluster
    return cluster


ClusterDep = Annotated[Cluster, Depends(get_cluster)]
Authorization = Annotated[str | None, Header(include_in_schema=False)]
UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


async def join_token_checked(cluster: ClusterDep, authorization: Authorization = None) -> None:
    if cluster.join_token is not None and not secrets_match(bearer(authorization), cluster.join_token):
        raise HTTPException(401, "a node must present the cluster's join token", headers=UNAUTHORIZED)


def check_api_key(cluster: Cluster, authorization: str | None) -> None:
    if cluster.api_key is not None and not secrets_match(bearer(authorization), cluster.api_key):
        raise HTTPException(401, "a valid API key is required", headers=UNAUTHORIZED)


async def api_key_checked(cluster: ClusterDep, authorization: Authorization = None) -> None:
    check_api_key(cluster, authorization)


StateName = Literal["FAILED", "BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]


class RoomRequest(BaseModel):
    """Strict: a number sent as a string is refused, as the schema says."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: PromptText | None = Field(None, description="text, tokenized with the model's tokenizer")
    input_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    max_new_tokens: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _one_input(self) -> "RoomRequest":
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        return self

    def tokens(self, cluster: Cluster) -> list[int]:
        """The room's prompt, checked as a node will take it; Refused otherwise."""
        param = "input_ids" if self.prompt is None else "prompt"
        tokens = self.input_ids or encode(cluster.tokenizer, self.prompt or "", param)
        check_room(cluster.tokenizer, cluster.settings, tokens, self.max_new_tokens, param, "max_new_tokens")
        return tokens


nodes = APIRouter(tags=["nodes"], dependencies=[Depends(join_token_checked)])
nodes_open = APIRouter(tags=["nodes"])
rooms_router = APIRouter(tags=["rooms"], dependencies=[Depends(api_key_checked)])
# The routes every client calls per room: they take the raw request and check it themselves.
hot_rooms = APIRouter(tags=["rooms"], route_class=PlainRoute)
ops = APIRouter(tags=["operations"])


async def _node(cluster: Cluster, node_id: str) -> Node:
    node = await cluster.node(node_id)
    if node is None:
        raise HTTPException(404, f"node {node_id} is not registered")
    return node


@nodes.post("/nodes", status_code=201)
async def register_node(reg: NodeRegistration, cluster: ClusterDep) -> dict[str, Any]:
    try:
        node = await cluster.register(reg)
    except Incompatible as exc:
        raise HTTPException(409, str(exc)) from exc
    return (await cluster.registered(node)).model_dump()


@nodes.get("/params-key")
async def params_key(cluster: ClusterDep) -> ParamsKey:
    """The cluster's key for transfer parameters, for a vLLM API server's check of each request."""
    return ParamsKey(params_key=(await cluster.store.params_key()).hex())


@nodes.put("/nodes/{node_id}/heartbeat")
async def heartbeat(node_id: str, beat: Heartbeat, cluster: ClusterDep) -> dict[str, Any]:
    node = await cluster.heartbeat(node_id, beat)
    if node is None:
        raise HTTPException(404, f"node {node_id} is not registered")
    return (await cluster.registered(node, beat)).model_dump()


@nodes.post("/nodes/{node_id}/drain")
async def drain_node(node_id: str, cluster: ClusterDep) -> dict[str, Any]:
    await _node(cluster, node_id)
    node = await cluster.drain(node_id)
    assert node is not None
    return node.view()


@nodes.delete("/nodes/{node_id}")
async def remove_node(node_id: str, cluster: ClusterDep, cause: LeaveCause | None = None) -> dict[str, Any]:
    node = await _node(cluster, node_id)
    await cluster.forget(node_id, cause or "operator")
    return node.view()


@nodes_open.get("/nodes")
async def list_nodes(cluster: ClusterDep) -> list[dict[str, Any]]:
    return [node.view() for node in await cluster.nodes()]


WAIT = TypeAdapter(Annotated[float, Field(ge=0)])
ROOM_ID = TypeAdapter(int)
ROOM_REQUEST = TypeAdapter(RoomRequest)
WAIT_PARAMETER = parameter("wait", "query", WAIT, 0, "seconds to wait for the room to finish")


async def room_view(cluster: Cluster, room: RoomData) -> dict[str, Any]:
    streamed = await cluster.store.tokens(room.room) if room.partial else None
    return rooms.view(room, cluster.tokenizer.decode, cluster.sessions, streamed)


async def room_response(cluster: Cluster, room: RoomData, status: int = 200) -> Response:
    # Encoded directly: the view is plain data, and this is the hot path of every client.
    return Response(
        msgspec.json.encode(await room_view(cluster, room)), status, media_type="application/json"
    )


def unavailable(exc: StoreUnavailable) -> HTTPException:
    """The store (Redis) is gone: nothing can be read or placed until it is back. Retry later."""
    return HTTPException(503, f"the bootstrap's store is unavailable: {exc}", {"Retry-After": "1"})


def check_wait(cluster: Cluster, wait: float) -> None:
    if wait > cluster.settings.max_wait_s:
        raise HTTPException(422, f"wait above {cluster.settings.max_wait_s}s")


async def wait_finished(cluster: Cluster, room: RoomData, wait: float) -> RoomData:
    if not wait or room.done:
        return room
    return await cluster.wait(room.room, wait, lambda r: r.done) or room


async def place(
    cluster: Cluster, tokens: list[int], max_new_tokens: int, stop: list[str], stream: bool
) -> RoomData:
    """Place a room whose request was checked (``bootstrap.validation``)."""
    try:
        return await cluster.place(tokens, max_new_tokens, stop, stream)
    except NoLiveNode as exc:
        raise HTTPException(503, str(exc)) from exc
    except NeverFits as exc:
        raise HTTPException(400, f"{exc}: it can never be placed") from exc
    except NoCapacity as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": "1"}) from exc


@hot_rooms.post(
    "/rooms",
    status_code=201,
    response_class=Response,
    responses=VALIDATION_ERROR,
    openapi_extra={"parameters": [WAIT_PARAMETER], "requestBody": json_body_entry(ROOM_REQUEST)},
)
async def create_room(request: Request) -> Response:
    """Create a room; with ``?wait=`` answer once it finished or the wait ran out."""
    cluster: Cluster = request.app.state.cluster
    check_api_key(cluster, header(request, b"authorization"))
    errors: Errors = []
    wait = query(request, "wait", WAIT, 0, errors)
    body: RoomRequest = await json_body(request, ROOM_REQUEST, errors)
    if errors:
        raise RequestValidationError(errors)
    check_wait(cluster, wait)  # before the room is placed
    room = await place(cluster, body.tokens(cluster), body.max_new_tokens, [], False)
    return await room_response(cluster, await wait_finished(cluster, room, wait), 201)


async def _room(cluster: Cluster, room_id: RoomId) -> RoomData:
    room = await cluster.store.room(room_id)
    if room is None:
        raise HTTPException(404, f"room {room_id} is not known")
    return room


@hot_rooms.get(
    "/rooms/{room}",
    response_class=Response,
    responses=VALIDATION_ERROR,
    openapi_extra={"parameters": [parameter("room", "path", ROOM_ID), WAIT_PARAMETER]},
)
async def get_room(request: Request) -> Response:
    """The room; with ``?wait=`` answer once it finished or the wait ran out."""
    cluster: Cluster = request.app.state.cluster
    check_api_key(cluster, header(request, b"authorization"))
    errors: Errors = []
    room = RoomId(validate(ROOM_ID, request.path_params["room"], ("path", "room"), errors))
    wait = query(request, "wait", WAIT, 0, errors)
    if errors:
        raise RequestValidationError(errors)
    check_wait(cluster, wait)
    found = await _room(cluster, room)
    return await room_response(cluster, await wait_finished(cluster, found, wait))


@rooms_router.get("/rooms")
async def list_rooms(
    cluster: ClusterDep,
    state: Annotated[StateName | None, Query(description="only rooms in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> list[dict[str, Any]]:
    found = []
    for room in await cluster.store.recent(cluster.settings.room_history if state else limit):
        view = await room_view(cluster, room)
        if state is None or view["state"] == state:
            found.append(view)
            if len(found) == limit:
                break
    return found


@rooms_router.delete("/rooms/{room}")
async def abort_room(room: int, cluster: ClusterDep) -> dict[str, Any]:
    room_id = RoomId(room)
    await _room(cluster, room_id)
    if not await cluster.abort(room_id):
        ended = await _room(cluster, room_id)
        raise HTTPException(409, f"room {room_id} already ended {(await room_view(cluster, ended))['state']}")
    return await room_view(cluster, await _room(cluster, room_id))


@ops.get("/health", response_model=None)
async def health(cluster: ClusterDep) -> JSONResponse:
    try:
        await cluster.store.ping()
        problem = cluster.healthy
    except StoreUnavailable as exc:
        problem = str(exc)
    body = {
        "status": "ok" if problem is None else "unavailable",
        "problem": problem,
        "role": "bootstrap",
        "id": cluster.id,
        "store": "redis" if cluster.settings.store.startswith("redis") else "memory",
        "zmq_security": "curve" if cluster.security.keys else "plain",
        "join_token_required": cluster.join_token is not None,
        "live_prefill_nodes": cluster.live_count("prefill"),
        "live_decode_nodes": cluster.live_count("decode"),
        "rooms_in_flight": cluster.in_flight_count,
        "queued_rooms": cluster.queued,
    }
    return JSONResponse(body, status_code=200 if problem is None else 503)


@ops.get("/metrics")
async def metrics(cluster: ClusterDep) -> Response:
    return Response(cluster.metrics.render(), media_type=CONTENT_TYPE_LATEST)
