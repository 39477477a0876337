"""The bootstrap's REST API: thin routers over the Cluster.

Node routes need the join secret, client routes the API key when one is set
(both as ``Authorization: Bearer``); health, metrics and the status page stay
open.
"""

import asyncio
import contextlib
from typing import Annotated, Any, Literal

import msgspec
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from bootstrap.cluster import Cluster, NoLiveNode
from bootstrap.registry import Incompatible, Node
from bootstrap.rooms import RoomRecord
from shared.metrics import CONTENT_TYPE_LATEST
from shared.registration import Heartbeat, NodeRegistration
from shared.security import bearer, secrets_match


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


async def api_key_checked(cluster: ClusterDep, authorization: Authorization = None) -> None:
    if cluster.api_key is not None and not secrets_match(bearer(authorization), cluster.api_key):
        raise HTTPException(401, "a valid API key is required", headers=UNAUTHORIZED)


StateName = Literal["FAILED", "BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]


class RoomRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = Field(None, min_length=1, description="text, tokenized with the model's tokenizer")
    input_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    max_new_tokens: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _one_input(self) -> "RoomRequest":
        if (self.prompt is None) == (self.input_ids is None):
            raise ValueError("give exactly one of prompt or input_ids")
        return self

    def tokens(self, cluster: Cluster) -> list[int]:
        if self.input_ids is None:
            return cluster.tokenizer.encode(self.prompt or "")
        vocab = cluster.tokenizer.vocab_size
        if any(t >= vocab for t in self.input_ids):
            raise HTTPException(422, f"input_ids must be below the vocabulary size {vocab}")
        return self.input_ids


nodes = APIRouter(tags=["nodes"], dependencies=[Depends(join_token_checked)])
nodes_open = APIRouter(tags=["nodes"])
rooms = APIRouter(tags=["rooms"], dependencies=[Depends(api_key_checked)])
ops = APIRouter(tags=["operations"])


def _node(cluster: Cluster, node_id: str) -> Node:
    node = cluster.registry.nodes.get(node_id)
    if node is None:
        raise HTTPException(404, f"node {node_id} is not registered")
    return node


@nodes.post("/nodes", status_code=201)
async def register_node(reg: NodeRegistration, cluster: ClusterDep) -> dict[str, Any]:
    try:
        node = cluster.register(reg)
    except Incompatible as exc:
        raise HTTPException(409, str(exc)) from exc
    return cluster.registered(node).model_dump()


@nodes.put("/nodes/{node_id}/heartbeat")
async def heartbeat(node_id: str, beat: Heartbeat, cluster: ClusterDep) -> dict[str, Any]:
    node = cluster.registry.heartbeat(node_id, beat)
    if node is None:
        raise HTTPException(404, f"node {node_id} is not registered")
    cluster.heartbeat_changed(node)
    return cluster.registered(node).model_dump()


@nodes.post("/nodes/{node_id}/drain")
async def drain_node(node_id: str, cluster: ClusterDep) -> dict[str, Any]:
    node = _node(cluster, node_id)
    cluster.drain(node)
    return node.view()


@nodes.delete("/nodes/{node_id}")
async def remove_node(node_id: str, cluster: ClusterDep) -> dict[str, Any]:
    node = _node(cluster, node_id)
    cluster.forget(node)
    return node.view()


@nodes_open.get("/nodes")
async def list_nodes(cluster: ClusterDep) -> list[dict[str, Any]]:
    return [node.view() for node in cluster.registry.nodes.values()]


WaitQuery = Annotated[float, Query(ge=0, description="seconds to wait for the room to finish")]


def room_response(record: RoomRecord, status: int = 200) -> Response:
    # Encoded directly: the view is plain data, and this is the hot path of every client.
    return Response(msgspec.json.encode(record.view()), status, media_type="application/json")


def check_wait(cluster: Cluster, wait: float) -> None:
    if wait > cluster.settings.max_wait_s:
        raise HTTPException(422, f"wait above {cluster.settings.max_wait_s}s")


async def wait_finished(record: RoomRecord, wait: float) -> None:
    if wait and not record.done.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(record.done.wait(), wait)


def check_limits(cluster: Cluster, tokens: list[int], max_new_tokens: int) -> None:
    s = cluster.settings
    if len(tokens) > s.max_prompt_tokens:
        raise HTTPException(422, f"prompt of {len(tokens)} tokens exceeds the cap of {s.max_prompt_tokens}")
    if max_new_tokens > s.max_new_tokens:
        raise HTTPException(422, f"max_new_tokens above the cap of {s.max_new_tokens}")


def place(
    cluster: Cluster, tokens: list[int], max_new_tokens: int, stop: list[str], stream: bool
) -> RoomRecord:
    check_limits(cluster, tokens, max_new_tokens)
    try:
        return cluster.place(tokens, max_new_tokens, stop, stream)
    except NoLiveNode as exc:
        raise HTTPException(503, str(exc)) from exc


@rooms.post("/rooms", status_code=201, response_class=Response)
async def create_room(body: RoomRequest, cluster: ClusterDep, wait: WaitQuery = 0) -> Response:
    """Create a room; with ``?wait=`` answer once it finished or the wait ran out."""
    check_wait(cluster, wait)  # before the room is placed
    record = place(cluster, body.tokens(cluster), body.max_new_tokens, [], False)
    await wait_finished(record, wait)
    return room_response(record, 201)


def _record(cluster: Cluster, room: int) -> RoomRecord:
    record = cluster.book.rooms.get(room)
    if record is None:
        raise HTTPException(404, f"room {room} is not known")
    return record


@rooms.get("/rooms/{room}", response_class=Response)
async def get_room(room: int, cluster: ClusterDep, wait: WaitQuery = 0) -> Response:
    """The room; with ``?wait=`` answer once it finished or the wait ran out."""
    check_wait(cluster, wait)
    record = _record(cluster, room)
    await wait_finished(record, wait)
    return room_response(record)


@rooms.get("/rooms")
async def list_rooms(
    cluster: ClusterDep,
    state: Annotated[StateName | None, Query(description="only rooms in this state")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> list[dict[str, Any]]:
    found = []
    for record in reversed(cluster.book.rooms.values()):
        view = record.view()
        if state is None or view["state"] == state:
            found.append(view)
            if len(found) == limit:
                break
    return found


@rooms.delete("/rooms/{room}")
async def abort_room(room: int, cluster: ClusterDep) -> dict[str, Any]:
    record = _record(cluster, room)
    if not cluster.abort(record):
        raise HTTPException(409, f"room {room} already ended {record.view()['state']}")
    return record.view()


@ops.get("/health")
async def health(cluster: ClusterDep) -> dict[str, Any]:
    return {
        "status": "ok",
        "role": "bootstrap",
        "zmq_security": "curve" if cluster.security.keys else "plain",
        "join_token_required": cluster.join_token is not None,
        "live_prefill_nodes": cluster.registry.live_count("prefill"),
        "live_decode_nodes": cluster.registry.live_count("decode"),
        "rooms_in_flight": len(cluster.book.in_flight()),
    }


@ops.get("/metrics")
async def metrics(cluster: ClusterDep) -> Response:
    return Response(cluster.metrics.render(), media_type=CONTENT_TYPE_LATEST)
