"""One tensor-parallel rank of a node: what it owns, and the part of its logic both roles share.

A rank owns a transfer engine (its own session id), a KV pool holding its
share of the KV heads, its ZMQ identity and sockets, and a model worker. Its
rooms' states are the states the node's ranks agreed on (``shared.node.agreement``):
what the rank alone has reached is ``RankRoom.local``.

Room assignments and the bootstrap's aborts reach rank 0 only; its leader
checks they come from the bootstrap and gives them to every rank in one order
(``shared.node.leader``). Everything else about a room comes from the room's
peer ranks, and is taken only from their keys.

Everything a rank uses is handed to it (``shared.node.builder`` assembles a
node): its engine, pool, model source, event loop, where its reports go and how
it reaches its peers, so a rank can also live inside another program.
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
from shared.kv.transfer import TransferEngine
from shared.metrics import ServiceMetrics
from shared.models.source import KVSource
from shared.node.agreement import OnAgreed, Participant
from shared.node.settings import NodeSettings
from shared.room.record import Room, RoomTable
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.security import Security, ZapHandler
from shared.wire.zmq_io import PushSockets, bind_pull

log = logging.getLogger(__name__)
T = TypeVar("T")
Assignment = protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom
Item = TypeVar("Item", Assignment, protocol.TransferRequest)


class Peers(Protocol):
    """How a rank reaches its peer ranks: one message, with its aux bytes; False if it could not go."""

    def send(self, peer: protocol.PeerRank, msg: protocol.Message, aux: bytes | None = None) -> bool: ...


class PeerSockets:
    """Peers over CURVE-secured ZMQ push sockets."""

    def __init__(self, push: PushSockets):
        self._push = push

    def send(self, peer: protocol.PeerRank, msg: protocol.Message, aux: bytes | None = None) -> bool:
        return self._push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(msg, aux))


class Rank:
    """What one rank owns: its transfer engine, KV pool (registered with the engine), ZMQ identity
    and sockets. ``peers`` replaces the sockets to peer ranks (a test records what is sent)."""

    def __init__(
        self,
        settings: NodeSettings,
        index: int,
        source: KVSource,
        security: Security,
        engine: TransferEngine,
        pool: KVPool,
        peers: Peers | None = None,
    ):
        self.index = index
        self.settings = settings
        self.source = source
        self.security = security
        self.layout = pool.layout
        self.engine = engine
        self.pool = pool
        self.zmq = zmq.Context()
        self._zap = ZapHandler(self.zmq) if security.keys else None
        self.push = PushSockets(self.zmq, security)
        self.peers = peers or PeerSockets(self.push)

    def info(self) -> protocol.PeerRank:
        """How peers reach this rank: its registration entry, and its part of every assignment."""
        heads = self.source.kv_heads
        return protocol.PeerRank(
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
        return self.peers.send(peer, msg, aux)

    def close(self) -> None:
        self.push.close()
        if self._zap is not None:
            self._zap.close()
        self.zmq.term()
        self.engine.close()


class Reports(Protocol):
    """What a rank's logic tells the bootstrap: rank 0's go out (``shared.node.reports``), the other
    ranks' nowhere."""

    def report(self, room: Room) -> None: ...

    def tokens(self, room: protocol.TransferId, offset: int, tokens: list[int]) -> None: ...


class NoReports:
    """A rank other than 0: the node speaks through rank 0."""

    def report(self, room: Room) -> None:
        pass

    def tokens(self, room: protocol.TransferId, offset: int, tokens: list[int]) -> None:
        pass


AgreementFactory = Callable[[OnAgreed], Participant]
"""Makes a rank's agreement participant around the service's ``on_agreed``."""

ASSIGNMENTS = (protocol.Assignments, protocol.PrefillRoom, protocol.DecodeRoom)


def assignments_in(msg: protocol.Assignments | Assignment) -> list[Assignment]:
    if isinstance(msg, protocol.Assignments):
        return [*msg.prefill_rooms, *msg.decode_rooms, *msg.aborts]
    return [msg]


def refuse_assignment(msg: protocol.Assignments | Assignment, sender: str | None) -> None:
    """An assignment from anyone but the bootstrap is dropped and counted."""
    batch = assignments_in(msg)
    raise RejectedMessage(
        f"{type(msg).__name__} from {sender or 'an unknown sender'}, not the bootstrap",
        room=batch[0].transfer if batch else None,
        kind="unauthorized",
    )


class RankRoom(Room):
    """A room on one rank: ``state`` is what the ranks agreed; ``local`` is what this rank reached."""

    def __init__(self, room_id: protocol.TransferId, on_change: Callable[[Room], None]):
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
    # Messages handled ahead of others waiting with them on the socket; None: arrival order.
    urgent: Callable[[list[Any]], bool] | None = None
    # States this rank's rooms report to the bootstrap (rank 0 only).
    reported_states: frozenset[RoomState] = frozenset(RoomState) - {RoomState.BOOTSTRAPPING}

    def __init__(
        self,
        rank: Rank,
        reports: Reports,
        agreement: AgreementFactory,
        metrics: ServiceMetrics,
        loop: asyncio.AbstractEventLoop,
    ):
        self.rank = rank
        self.settings = rank.settings
        self.pool: KVPool = rank.pool
        self.layout = rank.layout
        self.source = rank.source
        self.reports = reports
        self.agree = agreement(self.on_agreed)
        self.metrics = metrics
        self.loop = loop
        self.rooms = RoomTable()
        self.model = ModelWorker()
        # Verify mode: the pool's page digests (the prefill's while its writes are out).
        self.digester = Digester(self.pool) if self.settings.verify_kv else None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.set_up()

    def set_up(self) -> None:
        """The role's own state, made once the common parts above exist."""

    # -- what subclasses provide ------------------------------------------------

    @abc.abstractmethod
    def handle_peer(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        """A message from a peer rank; raise RejectedMessage to drop it."""

    @abc.abstractmethod
    def handle_assignment(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        """A room assignment or abort from the bootstrap, in the order the node's leader gave it."""

    @abc.abstractmethod
    def on_agreed(self, room: protocol.TransferId, state: RoomState, reason: str | None) -> None:
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
        """A message from the network that is not the bootstrap's: assignments are refused (they
        reach rank 0's leader only), the rest is a peer's."""
        if isinstance(msg, ASSIGNMENTS):
            refuse_assignment(msg, sender)
        self.handle_peer(msg, aux, sender)

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
                    "transfer=%d dropped %s (%s): %s",
                    item.transfer,
                    name,
                    exc.kind,
                    exc,
                    extra={"room": item.transfer},
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
            self.reports.report(room)

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
