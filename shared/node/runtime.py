"""A node's processes: the event loop, signals, the HTTP server and the rank processes.

``run_node`` is the entry point of ``python -m prefill_node`` and
``python -m decode_node``. The process it starts is rank 0 and the node's
leader; with ``--tp-size N`` it starts ranks 1..N-1 as child processes
(``multiprocessing`` spawn), which die with it. All ranks join one
torch.distributed gloo group (the model's collectives; the gloo agreement has
a group of its own).

Each process builds its part of the node with ``shared.node.builder``.
SIGTERM drains (``Node.drain``): the node tells the bootstrap to place nothing more here, lets
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
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import JSONResponse

from shared.heap import freeze_startup_heap
from shared.logs import configure_logging
from shared.metrics import CONTENT_TYPE_LATEST, NO_OPENTELEMETRY, ServiceMetrics
from shared.models.reference import AllReduce, configure_determinism
from shared.models.source import make_source
from shared.node import agreement
from shared.node.builder import Node, Role, agreement_for, build_service, make_rank
from shared.node.leader import RankLinks, leader_endpoint, rank_endpoint
from shared.node.rank import NoReports
from shared.node.reports import room_view
from shared.node.settings import NodeSettings
from shared.wire import protocol
from shared.wire.security import Security, security_for
from shared.wire.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)

RANK_HEALTH_INTERVAL_S = 0.25
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


def run_node(role: Role, settings: NodeSettings) -> None:
    configure_logging(settings.log_level, settings.log_format, role.name)
    configure_determinism()
    _exit_now(uvloop.run(_leader(role, settings)))


def _exit_now(status: int = 0) -> None:
    """Exit once the node stopped, without waiting for a model thread still decoding a room that
    was ended ``shutdown`` (or stuck in a collective with a dead rank): the interpreter would join it."""
    logging.shutdown()
    os._exit(status)


def http_app(node: Node) -> FastAPI:
    app = FastAPI(title=f"kvroom {node.role.name} node", telemetry=NO_OPENTELEMETRY)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = node.health()
        return JSONResponse(body, 200 if body["problem"] is None else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        return Response(node.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/transfers/{transfer}")
    async def transfer_view(transfer: int) -> dict[str, Any]:
        found = node.service.rooms.find(protocol.TransferId(transfer))
        if found is None:
            raise HTTPException(404, f"transfer {transfer} is not known to this node")
        return room_view(found)

    return app


async def _leader(role: Role, settings: NodeSettings) -> int:
    """The node's life in rank 0's process; its exit status (1: it stopped because a rank died)."""
    loop = asyncio.get_running_loop()
    world = settings.tp_size
    children: list[multiprocessing.process.BaseProcess] = []
    link_dir = Path(tempfile.mkdtemp(prefix=f"kvroom-{role.name}-"))
    group = None
    all_reduce = None
    if world > 1:
        port = settings.dist_port or _free_port()
        ctx = multiprocessing.get_context("spawn")
        for r in range(1, world):
            child = ctx.Process(
                target=rank_main,
                args=(role, settings, r, link_dir, port),
                name=f"{role.name}-rank{r}",
                daemon=True,
            )
            child.start()
            children.append(child)
        all_reduce, group = await asyncio.to_thread(_join_group, settings, 0, port)
    security = security_for(settings.zmq_security, settings.curve_key_file)
    rank = make_rank(settings, 0, make_source(settings, 0, all_reduce), security)
    links = RankLinks(rank.zmq, link_dir, world) if world > 1 else None
    pids = {r: child.pid for r, child in enumerate(children, start=1)}
    node = Node(role, settings, rank, loop, links, pids, group)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, node.stop)
    server = _EmbeddedServer(
        uvicorn.Config(
            http_app(node), host=settings.host, port=settings.http_port, log_config=None, lifespan="off"
        )
    )
    freeze_startup_heap()
    log.info(
        "%s node %s serving http=%s zmq=%s engine=%s tp=%d",
        role.name,
        node.node_id,
        settings.public_http_url,
        settings.public_zmq_endpoint(0),
        rank.engine.session_id,
        world,
    )
    try:
        async with asyncio.TaskGroup() as tg:
            http = tg.create_task(server.serve())
            watch = tg.create_task(_watch_children(node, children)) if children else None
            await node.serve()
            server.should_exit = True
            if watch is not None:
                watch.cancel()
            await http
    finally:
        for process in children:
            if process.is_alive():
                process.terminate()
        for process in children:
            process.join(10)
        node.close()
        shutil.rmtree(link_dir, ignore_errors=True)
        log.info("%s node %s stopped", role.name, node.node_id)
    return 0 if node.leader.broken is None else 1


async def _watch_children(node: Node, children: list[multiprocessing.process.BaseProcess]) -> None:
    loop = asyncio.get_running_loop()
    ended: asyncio.Queue[int] = asyncio.Queue()
    for index, child in enumerate(children, start=1):
        loop.add_reader(child.sentinel, ended.put_nowait, index)
    try:
        while True:
            index = await ended.get()
            loop.remove_reader(children[index - 1].sentinel)
            children[index - 1].join(1)  # reaped, so that its exit code is known
            node.rank_died(index, f"exited with code {children[index - 1].exitcode}")
    finally:
        for child in children:
            with contextlib.suppress(Exception):
                loop.remove_reader(child.sentinel)


# -- ranks 1..n-1 -----------------------------------------------------------------------


def rank_main(role: Role, settings: NodeSettings, index: int, link_dir: Path, port: int) -> None:
    """A rank process: dies with its leader, is stopped by it."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the leader
    configure_logging(settings.log_level, settings.log_format, f"{role.name} rank {index}")
    configure_determinism()
    uvloop.run(_follower(role, settings, index, link_dir, port))
    _exit_now()


async def _follower(role: Role, settings: NodeSettings, index: int, link_dir: Path, port: int) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    all_reduce, group = await asyncio.to_thread(_join_group, settings, index, port)
    security = security_for(settings.zmq_security, settings.curve_key_file)
    rank = make_rank(settings, index, make_source(settings, index, all_reduce), security)
    metrics = ServiceMetrics(
        role.name, f"{settings.resolved_node_id(role.name)}-rank{index}", settings.transport
    )
    to_leader = PushSockets(rank.zmq, Security(None))

    def send_leader(msg: protocol.Message) -> None:
        to_leader.send(leader_endpoint(link_dir), "", protocol.encode(msg))

    agree = agreement_for(settings, loop, index, to_leader=send_leader, group=group)
    service = build_service(role, rank, NoReports(), agree, metrics, loop)

    def from_leader(msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.RankAgreed):
            if isinstance(service.agree, agreement.FollowerParticipant):
                service.agree.agreed(msg.states)
        elif isinstance(msg, (protocol.PrefillRoom, protocol.DecodeRoom, protocol.AbortRoom)):
            service.handle_assignment(msg)

    pull = rank.bind()
    own = bind_pull(rank.zmq, rank_endpoint(link_dir, index))
    peer = rank.info()
    send_leader(protocol.RankReady(peer))

    async def tell_health() -> None:
        while True:
            send_leader(service.health())
            await asyncio.sleep(RANK_HEALTH_INTERVAL_S)

    freeze_startup_heap()
    log.info("%s rank %d serving zmq=%s engine=%s", role.name, index, peer.zmq_endpoint, peer.session_id)
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
        service.agree.close()
        pull.close(0)
        own.close(0)
        to_leader.close()
        service.shutdown()
        rank.close()
        log.info("%s rank %d stopped", role.name, index)
