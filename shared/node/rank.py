"""One tensor-parallel rank of a node: what it owns, and the part of its logic both roles share.

A rank owns a transfer engine (its own session id), a KV pool holding its
share of the KV heads, its ZMQ identity and sockets, and a model worker. Its
rooms' states are the states the node's ranks agreed on (``shared.node.agreement``):
what the rank alone has reached is ``RankRoom.local``.

Room assignments and the bootstrap's aborts reach rank 0 only; rank 0 checks
they come from the bootstrap and hands them to the node (``NodeHooks.assign``),
whose leader gives them to every rank in one order. Everything about a room
comes from the room's peer ranks, and is taken only from their keys.
"""

import abc
import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import zmq

from shared.errors import RejectedMessage
from shared.kv.digest import Digester
from shared.kv.pool import KVPool
from shared.kv.transfer import MooncakeEngine, TransferEngine
from shared.metrics import ServiceMetrics
from shared.models.source import KVSource
from shared.node.agreement import Participant
from shared.node.settings import NodeSettings
from shared.room.record import Room, RoomTable
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.registration import RankInfo
from shared.wire.security import Security, ZapHandler
from shared.wire.zmq_io import PushSockets, bind_pull

log = logging.getLogger(__name__)
T = TypeVar("T")
Item = TypeVar(
    "Item", protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom, protocol.TransferRequest
)


class Rank:
    """What one rank owns: its transfer engine, KV pool, ZMQ identity and sockets."""

    def __init__(
        self,
        settings: NodeSettings,
        index: int,
        source: KVSource,
        security: Security,
        engine: TransferEngine | None = None,
    ):
        self.index = index
        self.settings = settings
        self.source = source
        self.security = security
        self.layout = source.kv_layout(settings.page_size)
        self.engine = engine or MooncakeEngine(
            settings.engine_host or settings.public_host,
            settings.transport,
            settings.rdma_devices,
            advertise_host=settings.public_host,
        )
        self.pool = KVPool(
            self.layout, settings.num_pages, settings.rank_device(index), scatter=settings.scatter_pages
        )
        self.engine.register(self.pool.base_ptr, self.pool.nbytes)
        self.zmq = zmq.Context()
        self._zap = ZapHandler(self.zmq) if security.keys else None
        self.push = PushSockets(self.zmq, security)

    def info(self) -> RankInfo:
        heads = self.source.kv_heads
        return RankInfo(
            rank=self.index,
            session_id=self.engine.session_id,
            zmq_endpoint=self.settings.public_zmq_endpoint(self.index),
            public_key=self.security.public_key,
            kv_head_start=heads.start,
            kv_head_count=heads.count,
        )

    def bind(self) -> zmq.Socket:
        return bind_pull(self.zmq, self.settings.bind_zmq_endpoint(self.index), self.security)

    def send(self, peer: protocol.PeerRank, msg: protocol.Message, aux: bytes | None = None) -> bool:
        return self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(msg, aux))

    def close(self) -> None:
        self.push.close()
        if self._zap is not None:
            self._zap.close()
        self.zmq.term()
        self.engine.close()


class NodeHooks(Protocol):
    """What a rank's logic tells its node; on ranks other than 0 these do nothing."""

    def is_bootstrap(self, sender: str | None) -> bool: ...

    def assign(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None: ...

    def report(self, room: Room) -> None: ...

    def tokens(self, room: int, offset: int, tokens: list[int]) -> None: ...


class RankRoom(Room):
    """A room on one rank: ``state`` is what the ranks agreed; ``local`` is what this rank reached."""

    def __init__(self, room_id: int, on_change: Callable[[Room], None]):
        super().__init__(room_id, on_change)
        self.local = RoomState.BOOTSTRAPPING
        self.local_since = time.monotonic()
        self.local_reason: str | None = None


class ModelWorker:
    """One thread that runs a rank's model work, in the order it is given: the order of the
    collectives, the same on every rank of the node."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")

    def submit(self, fn: Callable[..., T], *args: Any) -> "concurrent.futures.Future[T]":
        """Queue ``fn(*args)`` now; work runs in the order it was submitted."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RankService(abc.ABC):
    """A rank's room logic; the prefill and decode services fill in the rest."""

    role: str
    loop: asyncio.AbstractEventLoop
    # Messages handled ahead of others waiting with them on the socket; None: arrival order.
    urgent: Callable[[list[Any]], bool] | None = None
    # States this rank's rooms report to the bootstrap (rank 0 only).
    reported_states: frozenset[RoomState] = frozenset(RoomState) - {RoomState.BOOTSTRAPPING}

    def __init__(self, rank: Rank, node: NodeHooks, agree: Participant, metrics: ServiceMetrics):
        self.rank = rank
        self.settings = rank.settings
        self.pool: KVPool = rank.pool
        self.layout = rank.layout
        self.source = rank.source
        self.node = node
        self.agree = agree
        agree.on_agreed = self.on_agreed
        self.metrics = metrics
        self.rooms = RoomTable()
        self.model = ModelWorker()
        # Verify mode: the pool's page digests (the prefill's while its writes are out).
        self.digester = Digester(self.pool) if self.settings.verify_kv else None
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- what subclasses provide ------------------------------------------------

    @abc.abstractmethod
    def handle_peer(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        """A message from a peer rank; raise RejectedMessage to drop it."""

    @abc.abstractmethod
    def handle_assignment(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        """A room assignment or abort from the bootstrap, in the order the node's leader gave it."""

    @abc.abstractmethod
    def on_agreed(self, room: int, state: RoomState, reason: str | None) -> None:
        """The node's ranks agreed that ``room`` is in ``state``."""

    @abc.abstractmethod
    def health(self) -> protocol.RankHealth: ...

    async def background(self) -> None:
        """Periodic work (timeouts); runs until cancelled."""
        await asyncio.Event().wait()

    def shutdown(self) -> None:
        """Release what the subclass started."""
        self.model.close()
        if self.digester is not None:
            self.digester.close()

    # -- messages -----------------------------------------------------------------

    def on_message(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        """Everything that reaches this rank's network socket."""
        batch: list[protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom]
        if isinstance(msg, protocol.Assignments):
            batch = [*msg.prefill_rooms, *msg.decode_rooms, *msg.aborts]
        elif isinstance(msg, (protocol.PrefillRoom, protocol.DecodeRoom)) or (
            isinstance(msg, protocol.AbortRoom) and self.node.is_bootstrap(sender)
        ):
            batch = [msg]
        else:
            self.handle_peer(msg, aux, sender)
            return
        if not self.node.is_bootstrap(sender):
            raise RejectedMessage(
                f"{type(msg).__name__} from {sender or 'an unknown sender'}, not the bootstrap",
                room=batch[0].room if batch else None,
                kind="unauthorized",
            )
        self.take_each(batch, self.node.assign)

    def take_each(self, items: Sequence[Item], take: Callable[[Item], None]) -> None:
        """Hand each item of a batch to ``take``, as if it came alone: one refused is counted and
        dropped, and costs only itself."""
        for item in items:
            try:
                take(item)
            except RejectedMessage as exc:
                self.metrics.rejected.labels(exc.kind).inc()
                name = type(item).__name__
                log.warning(
                    "room=%d dropped %s (%s): %s", item.room, name, exc.kind, exc, extra={"room": item.room}
                )

    def check_rank(self, rank: int, room: int) -> None:
        if rank != self.rank.index:
            raise RejectedMessage(f"rank {rank} is not served here", room=room, kind="bad_rank")

    @staticmethod
    def check_sender(sender: str | None, peer: protocol.PeerRank, room: int) -> None:
        """Whether a message about ``room`` really comes from ``peer`` (always true with security off)."""
        if sender is not None and sender != peer.public_key:
            raise RejectedMessage(
                f"message for rank {peer.rank}'s part of the room from another key",
                room=room,
                kind="unauthorized",
            )

    # -- room bookkeeping -------------------------------------------------------

    def set_local(self, job: RankRoom, state: RoomState, reason: str | None = None, digest: int = 0) -> None:
        """Record where the room stands on this rank and tell the agreement; never backwards."""
        if job.local.terminal or (state is not RoomState.FAILED and state <= job.local):
            return
        job.local, job.local_reason, job.local_since = state, reason, time.monotonic()
        self.agree.local(job.id, state, reason, digest)

    def room_changed(self, room: Room) -> None:
        if room.outcome is None:  # a transition; an outcome is counted where it is decided
            self.metrics.transitioned(room.state.name)
            if room.state is RoomState.FAILED:
                self.metrics.failures.labels(room.reason or "unknown").inc()
        if room.state.terminal and not self.holds(room):
            self.rooms.retire(room)
        if room.state in self.reported_states:
            self.node.report(room)

    def holds(self, room: Room) -> bool:
        """Whether the room still has work or memory on this rank after it ended."""
        return False

    def finished(self, room: Room) -> None:
        """The room's last work on this rank is over: it leaves the live table."""
        if room.state.terminal:
            self.rooms.retire(room)

    # -- tasks ----------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a tracked task; its failure is logged, never lost."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task failed", exc_info=task.exception())

    def cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()
