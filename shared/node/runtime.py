"""A node's processes: the event loop, signals, the HTTP server, the rank processes, and drain.

``run_node`` is the entry point of ``python -m prefill_node`` and
``python -m decode_node``. The process it starts is rank 0 and the node's
leader; with ``--tp-size N`` it starts ranks 1..N-1 as child processes
(``multiprocessing`` spawn), which die with it. All ranks join one
torch.distributed gloo group (the model's collectives; the gloo agreement has
a group of its own).

SIGTERM drains: the node tells the bootstrap to place nothing more here, lets
the rooms in flight finish for up to ``drain_grace_s``, fails the rest with
reason ``shutdown``, sends its last reports, leaves the cluster and exits.
"""

import asyncio
import contextlib
import ctypes
import datetime
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import uvloop
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse

from shared.heap import freeze_startup_heap
from shared.kv.transfer import TransferEngine
from shared.logs import configure_logging
from shared.metrics import CONTENT_TYPE_LATEST, NO_OPENTELEMETRY, ServiceMetrics
from shared.models.reference import AllReduce, configure_determinism
from shared.models.source import make_source
from shared.node import agreement
from shared.node.leader import NodeLeader, RankLinks, leader_endpoint, rank_endpoint
from shared.node.membership import Membership
from shared.node.rank import NodeHooks, Rank, RankService
from shared.node.settings import NodeSettings
from shared.room.record import Room
from shared.room.states import FailureReason
from shared.wire import protocol
from shared.wire.security import Security, security_for
from shared.wire.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)

ServiceFactory = Callable[[Rank, NodeHooks, agreement.Participant, ServiceMetrics], RankService]
RANK_HEALTH_INTERVAL_S = 0.25
# A draining node's calls to the bootstrap (it drains, it leaves) wait at most this long each.
LEAVE_TIMEOUT_S = 1.0
_PR_SET_PDEATHSIG = 1


class _EmbeddedServer(uvicorn.Server):
    """Leaves signal handling to the node, which owns the event loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _join_group(settings: NodeSettings, rank: int, port: int) -> tuple[AllReduce, object | None]:
    """Join the node's gloo group; the model's all-reduce, and the agreement's own group if gloo agrees."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=settings.tp_size,
        timeout=datetime.timedelta(seconds=120),
    )
    agreement_group = dist.new_group(backend="gloo") if settings.agreement == "gloo" else None

    def all_reduce(tensor: Any) -> None:
        dist.all_reduce(tensor)

    return all_reduce, agreement_group


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_node(role: str, settings: NodeSettings, factory: ServiceFactory) -> None:
    configure_logging(settings.log_level, settings.log_format, f"{role}")
    configure_determinism()
    uvloop.run(_leader(role, settings, factory))
    _exit_now()


def _exit_now() -> None:
    """Exit once the node stopped, without waiting for a model thread still decoding a room that
    was ended ``shutdown``: the interpreter would join it, however long its decode."""
    logging.shutdown()
    os._exit(0)


def http_app(role: str, leader: NodeLeader, metrics: ServiceMetrics) -> FastAPI:
    app = FastAPI(title=f"kvroom {role} node", telemetry=NO_OPENTELEMETRY)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = leader.health()
        return JSONResponse(body, 200 if body["problem"] is None else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/rooms/{room_id}")
    async def room(room_id: int) -> dict[str, Any]:
        found = leader.service.rooms.find(room_id)
        if found is None:
            raise HTTPException(404, f"room {room_id} is not known to this node")
        return found.view()

    return app


async def _leader(
    role: str, settings: NodeSettings, factory: ServiceFactory, engine: TransferEngine | None = None
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    node_id = settings.resolved_node_id(role)
    security = security_for(settings.zmq_security, settings.curve_key_file)
    world = settings.tp_size
    children: list[multiprocessing.process.BaseProcess] = []
    link_dir = Path(tempfile.mkdtemp(prefix=f"kvroom-{role}-"))
    group = None
    all_reduce = None
    if world > 1:
        port = settings.dist_port or _free_port()
        ctx = multiprocessing.get_context("spawn")
        for r in range(1, world):
            child = ctx.Process(
                target=rank_main,
                args=(role, settings, r, link_dir, port, factory),
                name=f"{role}-rank{r}",
                daemon=True,
            )
            child.start()
            children.append(child)
        all_reduce, group = await asyncio.to_thread(_join_group, settings, 0, port)
    source = make_source(settings, 0, all_reduce)
    rank = Rank(settings, 0, source, security, engine)
    metrics = ServiceMetrics(role, node_id, settings.transport)
    links = RankLinks(rank.zmq, link_dir, world) if world > 1 else None
    leader = NodeLeader(role, node_id, rank, world, links)
    leader.pids.update({r: child.pid for r, child in enumerate(children, start=1)})
    agree: agreement.Participant
    if world == 1:
        agree = agreement.Solo()
    elif settings.agreement == "gloo":
        agree = agreement.GlooParticipant(loop, 0, world, group)
    else:
        leader.agreement = agreement.Leader(world, leader.deliver)
        agree = agreement.LeaderParticipant(loop, leader.agreement)
    service = factory(rank, leader, agree, metrics)
    service.loop = loop
    leader.service = service

    def drain_now() -> None:
        leader.draining = True  # new rooms are refused from this moment, before the drain begins
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain_now)

    def known_rooms() -> list[Room]:
        return [*service.rooms.live.values(), *service.rooms.finished.values()]

    membership = Membership(
        settings, node_id, leader.registration, leader.heartbeat, rank.push.send, known_rooms, leader.orphaned
    )
    membership.loop = loop
    leader.membership = membership
    metrics.count_states(service.rooms.states)
    metrics.gauge_function(
        "kvroom_free_pages", "Free KV pages (the fewest of any rank)", lambda: leader.health()["free_pages"]
    )
    metrics.gauge_function("kvroom_total_pages", "KV pages in each rank's pool", lambda: rank.pool.num_pages)
    if role == "decode":
        metrics.gauge_function(
            "kvroom_free_aux_slots",
            "Free aux slots (the fewest of any rank)",
            lambda: leader.health()["free_aux_slots"],
        )
        metrics.gauge_function("kvroom_total_aux_slots", "Aux slots of each rank", lambda: settings.aux_slots)  # type: ignore[attr-defined]

    pull = rank.bind()
    server = _EmbeddedServer(
        uvicorn.Config(
            http_app(role, leader, metrics),
            host=settings.host,
            port=settings.http_port,
            log_config=None,
            lifespan="off",
        )
    )
    freeze_startup_heap()
    log.info(
        "%s node %s serving http=%s zmq=%s engine=%s tp=%d",
        role,
        node_id,
        settings.public_http_url,
        settings.public_zmq_endpoint(0),
        rank.engine.session_id,
        world,
    )
    try:
        async with asyncio.TaskGroup() as tg:
            http = tg.create_task(server.serve())
            loops = [
                tg.create_task(
                    receive_forever(pull, dispatcher(service.on_message, metrics), service.urgent)
                ),
                tg.create_task(service.background()),
            ]
            if links is not None:
                loops.append(
                    tg.create_task(receive_forever(links.pull, dispatcher(leader.on_rank_message, metrics)))
                )
                loops.append(tg.create_task(_watch_children(leader, children)))
                while not leader.ready and not stop.is_set() and leader.broken is None:
                    await asyncio.sleep(0.02)
            loops.append(tg.create_task(membership.run()))
            await stop.wait()
            await _drain(leader, membership, settings)
            server.should_exit = True
            for task in loops:
                task.cancel()
            service.cancel_tasks()
            await http
    finally:
        for process in children:
            if process.is_alive():
                process.terminate()
        for process in children:
            process.join(10)
        pull.close(0)
        if links is not None:
            links.close()
        service.shutdown()
        rank.close()
        log.info("%s node %s stopped", role, node_id)


async def _watch_children(leader: NodeLeader, children: list[multiprocessing.process.BaseProcess]) -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Queue[int] = asyncio.Queue()
    for index, child in enumerate(children, start=1):
        loop.add_reader(child.sentinel, ended.put_nowait, index)
    try:
        while True:
            index = await ended.get()
            loop.remove_reader(children[index - 1].sentinel)
            children[index - 1].join(0)
            leader.rank_died(index, f"exited with code {children[index - 1].exitcode}")
    finally:
        for child in children:
            with contextlib.suppress(Exception):
                loop.remove_reader(child.sentinel)


async def _drain(leader: NodeLeader, membership: Membership, settings: NodeSettings) -> None:
    """Place nothing more here, let rooms in flight end within the grace period, fail the rest.
    The bootstrap is told with short timeouts: a slow one does not stretch the grace."""
    deadline = time.monotonic() + settings.drain_grace_s
    leader.draining = True
    await membership.leave(timeout_s=LEAVE_TIMEOUT_S)
    while leader.rooms_in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    left = list(leader.service.rooms.live)
    if left:
        log.warning(
            "drain: %d rooms still in flight after %.1fs; failing them", len(left), settings.drain_grace_s
        )
        for room in left:
            leader.assign(protocol.AbortRoom(room=room, rank=0, reason=FailureReason.SHUTDOWN))
        await asyncio.sleep(0.1)  # their ends reach the reports
    membership.flush()
    await asyncio.sleep(0.05)  # ZMQ sends are queued: let them leave before the sockets close
    with contextlib.suppress(httpx.HTTPError):
        async with httpx.AsyncClient(base_url=settings.bootstrap_url, timeout=LEAVE_TIMEOUT_S) as client:
            await client.delete(f"/nodes/{leader.node_id}", headers=membership.auth)


# -- ranks 1..n-1 -----------------------------------------------------------------------


class _FollowerHooks:
    """A rank other than 0 reports nothing and takes no assignment from the network."""

    def is_bootstrap(self, sender: str | None) -> bool:
        return False

    def assign(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        raise AssertionError("only rank 0 takes assignments")

    def report(self, room: Room) -> None:
        pass

    def tokens(self, room: int, offset: int, tokens: list[int]) -> None:
        pass


def rank_main(
    role: str, settings: NodeSettings, index: int, link_dir: Path, port: int, factory: ServiceFactory
) -> None:
    """A rank process: dies with its leader, is stopped by it. ``factory`` is the role's service
    class, which the spawned process imports by name."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the leader
    configure_logging(settings.log_level, settings.log_format, f"{role} rank {index}")
    configure_determinism()
    uvloop.run(_follower(role, settings, index, link_dir, port, factory))
    _exit_now()


async def _follower(
    role: str, settings: NodeSettings, index: int, link_dir: Path, port: int, factory: ServiceFactory
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    all_reduce, group = await asyncio.to_thread(_join_group, settings, index, port)
    security = security_for(settings.zmq_security, settings.curve_key_file)
    source = make_source(settings, index, all_reduce)
    rank = Rank(settings, index, source, security)
    metrics = ServiceMetrics(role, f"{settings.resolved_node_id(role)}-rank{index}", settings.transport)
    to_leader = PushSockets(rank.zmq, Security(None))

    def send_leader(msg: protocol.Message) -> None:
        to_leader.send(leader_endpoint(link_dir), "", protocol.encode(msg))

    agree: agreement.Participant = (
        agreement.GlooParticipant(loop, index, settings.tp_size, group)
        if settings.agreement == "gloo"
        else agreement.FollowerParticipant(loop, index, send_leader)
    )
    service = factory(rank, _FollowerHooks(), agree, metrics)
    service.loop = loop

    def from_leader(msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.RankAgreed):
            if isinstance(agree, agreement.FollowerParticipant):
                agree.agreed(msg.states)
        elif isinstance(msg, (protocol.PrefillRoom, protocol.DecodeRoom, protocol.AbortRoom)):
            service.handle_assignment(msg)

    pull = rank.bind()
    own = bind_pull(rank.zmq, rank_endpoint(link_dir, index))
    peer = rank.info().peer()
    send_leader(protocol.RankReady(peer))

    async def tell_health() -> None:
        while True:
            send_leader(service.health())
            await asyncio.sleep(RANK_HEALTH_INTERVAL_S)

    freeze_startup_heap()
    log.info("%s rank %d serving zmq=%s engine=%s", role, index, peer.zmq_endpoint, peer.session_id)
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [
                tg.create_task(
                    receive_forever(pull, dispatcher(service.on_message, metrics), service.urgent)
                ),
                tg.create_task(receive_forever(own, dispatcher(from_leader, metrics))),
                tg.create_task(service.background()),
                tg.create_task(tell_health()),
            ]
            await stop.wait()
            for task in tasks:
                task.cancel()
            service.cancel_tasks()
    finally:
        agree.close()
        pull.close(0)
        own.close(0)
        to_leader.close()
        service.shutdown()
        rank.close()
        log.info("%s rank %d stopped", role, index)
