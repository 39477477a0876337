"""What the prefill and decode services share: sockets, HTTP, registration, reports.

A node hosts its ranks in one process; each rank owns a ZMQ PULL socket on
``zmq_port + rank``. Every message is decoded and checked on the event loop by
the subclass's ``handle``, which must be quick: model compute and engine calls
go to worker threads.
"""

import abc
import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import httpx
import uvicorn
import zmq
from fastapi import FastAPI, HTTPException, Response

from shared import protocol
from shared.errors import RegistrationError, RejectedMessage
from shared.heap import freeze_startup_heap
from shared.kv_pool import KVPool
from shared.metrics import CONTENT_TYPE_LATEST, NO_OPENTELEMETRY, ServiceMetrics
from shared.model import ModelConfig, ReferenceModel
from shared.room import Room, RoomTable
from shared.settings import NodeSettings
from shared.states import RoomState
from shared.transfer import MooncakeEngine, TransferEngine
from shared.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)

# How long room state changes are gathered before they go to the bootstrap in one
# message: briefly for a room that ended, longer for progress, which no one waits on
# and which would otherwise wake the bootstrap in the middle of most KV writes.
REPORT_DELAY_S = 0.002
PROGRESS_REPORT_DELAY_S = 0.05


class _EmbeddedServer(uvicorn.Server):
    """Leaves signal handling to the node, which owns the event loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class NodeService(abc.ABC):
    role: str
    loop: asyncio.AbstractEventLoop  # set when run() starts
    # Messages handled ahead of others waiting with them on the PULL socket; None: arrival order.
    urgent: Callable[[list[bytes]], bool] | None = None

    def __init__(self, settings: NodeSettings, engine: TransferEngine | None = None):
        self.settings = settings
        self.node_id = settings.resolved_node_id(self.role)
        self.metrics = ServiceMetrics(self.role)
        self.rooms = RoomTable()
        self.model = ReferenceModel(ModelConfig(), settings.device)
        self.layout = settings.kv_layout(self.model.config)
        self.engine = engine or MooncakeEngine(
            settings.engine_host or settings.public_host,
            settings.transport,
            settings.rdma_devices,
            advertise_host=settings.public_host,
        )
        self.pool = KVPool(self.layout, settings.num_pages, settings.device, scatter=settings.scatter_pages)
        self.engine.register(self.pool.base_ptr, self.pool.nbytes)
        self.rank = 0  # one rank per node for now; the protocol carries ranks throughout
        self.zmq = zmq.Context()
        self._push = PushSockets(self.zmq)
        self._report_endpoint: str | None = None
        self._pending_reports: dict[int, Room] = {}
        self._report_due = float("inf")  # loop time of the next flush; inf when none is set
        self._report_timer: asyncio.Handle | None = None
        self.token: str | None = None  # from the bootstrap, at registration
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stop = asyncio.Event()
        self.registered = asyncio.Event()
        self.metrics.count_states(self.rooms.states)
        self.metrics.gauge_function("kvroom_free_pages", "Free KV pages", lambda: self.pool.free_pages)
        self.metrics.gauge_function("kvroom_total_pages", "KV pages in the pool", lambda: self.pool.num_pages)

    # -- what subclasses provide ------------------------------------------------

    @abc.abstractmethod
    def handle(self, msg: protocol.Message, aux: memoryview | None) -> None:
        """Act on one decoded message; raise RejectedMessage to drop it."""

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "node_id": self.node_id,
            "role": self.role,
            "registered": self.registered.is_set(),
            "rooms_in_flight": len(self.rooms.live),
            "free_pages": self.pool.free_pages,
            "total_pages": self.pool.num_pages,
        }

    async def background(self) -> None:
        """Subclass hook for periodic work (timeouts); runs until stop."""
        await self._stop.wait()

    def check_origin(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        """Room assignments and aborts count only from our bootstrap and its nodes."""
        if self.token is None or msg.token != self.token:
            raise RejectedMessage(
                "room assignment without this cluster's token", room=msg.room, kind="unauthorized"
            )
        self.check_rank(msg.rank, msg.room)

    def check_rank(self, rank: int, room: int) -> None:
        if rank != self.rank:
            raise RejectedMessage(f"rank {rank} is not served here", room=room, kind="bad_rank")

    # -- room bookkeeping -------------------------------------------------------

    # States this node tells the bootstrap about; the bootstrap starts every room BOOTSTRAPPING.
    reported_states = frozenset(RoomState) - {RoomState.BOOTSTRAPPING}

    def room_changed(self, room: Room) -> None:
        self.metrics.transitions.labels(room.state.name).inc()
        if room.state is RoomState.FAILED:
            self.metrics.failures.labels(room.reason or "unknown").inc()
        if room.state.terminal:
            self.rooms.retire(room)
        if room.state in self.reported_states:
            self.report(room)

    def report(self, room: Room) -> None:
        """Tell the bootstrap where the room stands on this node.

        Changes are gathered for a moment and sent as one message, the latest
        state of each room with the time it entered every state: under load
        the bootstrap handles a few messages instead of one per transition.
        """
        self._pending_reports[room.id] = room
        due = self.loop.time() + (REPORT_DELAY_S if room.state.terminal else PROGRESS_REPORT_DELAY_S)
        if self._report_due <= due:
            return
        if self._report_timer is not None:
            self._report_timer.cancel()
        self._report_due = due
        self._report_timer = self.loop.call_at(due, self._flush_reports)

    def _flush_reports(self) -> None:
        self._report_due = float("inf")
        self._report_timer = None
        rooms = list(self._pending_reports.values())
        self._pending_reports.clear()
        if self._report_endpoint is None:
            return
        for start in range(0, len(rooms), protocol.MAX_REPORTS):
            statuses = [
                protocol.RoomStatus(
                    room=room.id,
                    state=int(room.state),
                    reason=room.reason,
                    timestamps=room.timestamps,
                    output_ids=room.output_ids,
                    timings=room.timings,
                )
                for room in rooms[start : start + protocol.MAX_REPORTS]
            ]
            self.send(self._report_endpoint, protocol.encode(protocol.RoomReports(self.node_id, statuses)))

    # -- sockets ----------------------------------------------------------------

    def send(self, endpoint: str, frames: list[bytes]) -> bool:
        return self._push.send(endpoint, frames)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a tracked task; its failure is logged, never lost."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task failed", exc_info=task.exception())

    # -- bootstrap ----------------------------------------------------------------

    def registration(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "role": self.role,
            "http_url": self.settings.public_http_url,
            "ranks": [
                {
                    "rank": self.rank,
                    "session_id": self.engine.session_id,
                    "zmq_endpoint": self.settings.public_zmq_endpoint(self.rank),
                }
            ],
            "kv_layout": {
                "num_layers": self.layout.num_layers,
                "num_kv_heads": self.layout.num_kv_heads,
                "head_dim": self.layout.head_dim,
                "page_size": self.layout.page_size,
                "dtype": self.layout.dtype,
            },
            "num_pages": self.pool.num_pages,
        }

    async def _register(self, client: httpx.AsyncClient) -> None:
        resp = await client.post("/nodes", json=self.registration())
        if resp.status_code != 201:
            raise RegistrationError(f"bootstrap refused registration: {resp.status_code} {resp.text}")
        body = resp.json()
        self._report_endpoint = body["report_endpoint"]
        self.token = body["token"]
        self.registered.set()
        log.info("registered with %s as %s", self.settings.bootstrap_url, self.node_id)

    async def _keep_registered(self) -> None:
        """Register, then heartbeat; register again whenever the bootstrap forgot us."""
        s = self.settings
        async with httpx.AsyncClient(base_url=s.bootstrap_url, timeout=5.0) as client:
            while True:
                try:
                    if not self.registered.is_set():
                        await self._register(client)
                    resp = await client.put(
                        f"/nodes/{self.node_id}/heartbeat",
                        json={"rooms_in_flight": len(self.rooms.live), "free_pages": self.pool.free_pages},
                    )
                    if resp.status_code == 404:
                        log.warning("bootstrap does not know this node; registering again")
                        self.registered.clear()
                        continue
                    resp.raise_for_status()
                except (httpx.HTTPError, RegistrationError) as exc:
                    log.warning("bootstrap unreachable or refusing: %s", exc)
                    self.registered.clear()
                    await asyncio.sleep(s.register_retry_s)
                    continue
                await asyncio.sleep(s.heartbeat_interval_s)

    # -- HTTP ---------------------------------------------------------------------

    def http_app(self) -> FastAPI:
        app = FastAPI(title=f"kvroom {self.role} node", telemetry=NO_OPENTELEMETRY)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            return self.health()

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/rooms/{room_id}")
        async def room(room_id: int) -> dict[str, Any]:
            found = self.rooms.find(room_id)
            if found is None:
                raise HTTPException(404, f"room {room_id} is not known to this node")
            return found.view()

        return app

    # -- lifecycle ----------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Subclass hook: release what the subclass started, before the engine closes."""

    async def run(self) -> None:
        self.loop = loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stop)
        s = self.settings
        pull = bind_pull(self.zmq, s.bind_zmq_endpoint(self.rank))
        config = uvicorn.Config(
            self.http_app(), host=s.host, port=s.http_port, log_config=None, lifespan="off"
        )
        server = _EmbeddedServer(config)
        freeze_startup_heap()
        log.info(
            "%s node %s serving http=%s zmq=%s engine=%s",
            self.role,
            self.node_id,
            s.public_http_url,
            s.public_zmq_endpoint(self.rank),
            self.engine.session_id,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                http = tg.create_task(server.serve())
                loops = [
                    tg.create_task(receive_forever(pull, dispatcher(self.handle, self.metrics), self.urgent)),
                    tg.create_task(self._keep_registered()),
                    tg.create_task(self.background()),
                ]
                await self._stop.wait()
                server.should_exit = True
                for task in [*loops, *self._tasks]:
                    task.cancel()
                await http
        finally:
            for task in list(self._tasks):
                task.cancel()
            pull.close(0)
            self._push.close()
            self.zmq.term()
            self.shutdown()
            self.engine.close()
            log.info("%s node %s stopped", self.role, self.node_id)
