"""How the ranks of one node agree on each room's state before any of them acts on it.

Each rank says where a room stands on that rank alone (``Participant.local``);
the agreed state is the minimum over the ranks (``decode_node.gate.node_verdict``:
FAILED if any rank failed, with its reason; SUCCESS only if every rank is ready
with the same aux record), and every rank is told each agreed change
(``on_agreed``), in the same order on every rank: the order in which their
models then decode.

Three ways to get there, one interface:

- ``Solo``: one rank; the agreed state is the rank's own, at once.
- ``Leader`` with ``LeaderParticipant`` / ``FollowerParticipant`` (``ipc``): each
  rank sends the rooms that changed in a turn of its event loop to rank 0's
  process in one message; the leader answers every rank with the changes
  they agree on.
- ``GlooParticipant`` (``gloo``): every rank all-gathers its table of rooms over
  a torch.distributed gloo group, round after round, and computes the
  agreement itself. The baseline the benchmark compares ``ipc`` with.
"""

import abc
import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable

import torch

from shared.room.gate import RankView, node_verdict
from shared.room.states import FailureReason, RoomState
from shared.wire import protocol

log = logging.getLogger(__name__)

OnAgreed = Callable[[protocol.TransferId, RoomState, str | None], None]
# Rooms whose agreement ended, remembered so that a late word about them is ignored.
_REMEMBER = 8192


class Participant(abc.ABC):
    """A rank's side of the agreement; it tells ``on_agreed`` (the rank's service) each agreed change."""

    def __init__(self, on_agreed: OnAgreed):
        self.on_agreed = on_agreed

    @abc.abstractmethod
    def local(
        self, room: protocol.TransferId, state: RoomState, reason: str | None = None, digest: int = 0
    ) -> None:
        """Where ``room`` stands on this rank alone; SUCCESS means ready, with the record's ``digest``."""

    def close(self) -> None:
        pass


class Solo(Participant):
    def local(
        self, room: protocol.TransferId, state: RoomState, reason: str | None = None, digest: int = 0
    ) -> None:
        self.on_agreed(room, *node_verdict({0: RankView(state, reason, digest)}, 1))


class _Ended:
    """A bounded memory of room ids."""

    def __init__(self) -> None:
        self._order: collections.deque[int] = collections.deque()
        self._set: set[int] = set()

    def add(self, room: int) -> None:
        self._order.append(room)
        self._set.add(room)
        if len(self._order) > _REMEMBER:
            self._set.discard(self._order.popleft())

    def __contains__(self, room: int) -> bool:
        return room in self._set


class Leader:
    """On rank 0's process: folds every rank's states into agreed ones and hands them out."""

    def __init__(self, world: int, deliver: Callable[[list[protocol.RankState]], None]):
        self.world = world
        self._deliver = deliver
        self._views: dict[int, dict[int, RankView]] = {}
        self._agreed: dict[int, tuple[RoomState, str | None]] = {}
        self._ended = _Ended()

    def contribute(self, rank: int, states: list[protocol.RankState]) -> None:
        changes = []
        for s in states:
            if s.transfer in self._ended:
                continue
            views = self._views.setdefault(s.transfer, {})
            views[rank] = RankView(RoomState(s.state), s.reason, s.digest)
            state, reason = node_verdict(views, self.world)
            if self._agreed.get(s.transfer) == (state, reason):
                continue
            self._agreed[s.transfer] = (state, reason)
            changes.append(protocol.RankState(s.transfer, int(state), reason))
            if state.terminal:
                del self._views[s.transfer], self._agreed[s.transfer]
                self._ended.add(s.transfer)
        if changes:
            self._deliver(changes)

    def rooms(self) -> int:
        return len(self._views)


class _Batched(Participant):
    """Gathers a turn's local changes and hands them on once, at the end of the turn."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rank: int, on_agreed: OnAgreed):
        super().__init__(on_agreed)
        self._loop = loop
        self._rank = rank
        self._pending: dict[int, protocol.RankState] = {}

    def local(
        self, room: protocol.TransferId, state: RoomState, reason: str | None = None, digest: int = 0
    ) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending[room] = protocol.RankState(room, int(state), reason, digest)

    def _flush(self) -> None:
        states, self._pending = list(self._pending.values()), {}
        self.send(states)

    @abc.abstractmethod
    def send(self, states: list[protocol.RankState]) -> None: ...

    def agreed(self, states: list[protocol.RankState]) -> None:
        for s in states:
            self.on_agreed(s.transfer, RoomState(s.state), s.reason)


class LeaderParticipant(_Batched):
    """Rank 0 of an ``ipc`` node: it holds the ``Leader``, takes its own changes straight in and the
    other ranks' by ``contribute``, and hands each agreed change to every rank in one order: the
    others by ``broadcast`` (the node's ipc link), itself at once."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        world: int,
        broadcast: Callable[[protocol.Message], None],
        on_agreed: OnAgreed,
    ):
        super().__init__(loop, 0, on_agreed)
        self._broadcast = broadcast
        self.leader = Leader(world, self._deliver)

    def send(self, states: list[protocol.RankState]) -> None:
        self.leader.contribute(0, states)

    def contribute(self, rank: int, states: list[protocol.RankState]) -> None:
        """Another rank's changes, from the ipc link."""
        self.leader.contribute(rank, states)

    def _deliver(self, changes: list[protocol.RankState]) -> None:
        self._broadcast(protocol.RankAgreed(changes))
        self.agreed(changes)


class FollowerParticipant(_Batched):
    """Rank r > 0 of an ``ipc`` node: its changes go to the leader over the node's ipc link."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        rank: int,
        to_leader: Callable[[protocol.Message], None],
        on_agreed: OnAgreed,
    ):
        super().__init__(loop, rank, on_agreed)
        self._to_leader = to_leader

    def send(self, states: list[protocol.RankState]) -> None:
        self._to_leader(protocol.RankStates(self._rank, states))


# Rooms a gloo round carries per rank; more at once wait for the next round.
GLOO_ROOMS = 1024
# Between rounds when no rank has a room in flight.
GLOO_IDLE_S = 0.01
_REASONS = [None, *FailureReason]


class GlooParticipant(Participant):
    """Agreement by all-gathering every rank's room table over a gloo group, in a thread.

    A round gathers, from every rank, up to GLOO_ROOMS rows of (room, state,
    reason, digest); each rank then applies ``node_verdict`` to every room and
    hands the changes, sorted by room id (the same order everywhere), to its
    event loop. Every rank runs the same rounds: whether to pause before the
    next is decided from the gathered data, the same on all ranks.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, rank: int, world: int, group: object, on_agreed: OnAgreed
    ):
        super().__init__(on_agreed)
        self._loop = loop
        self._rank = rank
        self._world = world
        self._group = group
        self._lock = threading.Lock()
        self._table: dict[int, protocol.RankState] = {}
        self._agreed: dict[int, tuple[RoomState, str | None]] = {}
        self._ended = _Ended()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gloo-agreement", daemon=True)
        self._thread.start()

    def local(
        self, room: protocol.TransferId, state: RoomState, reason: str | None = None, digest: int = 0
    ) -> None:
        with self._lock:
            self._table[room] = protocol.RankState(room, int(state), reason, digest)

    def _rows(self) -> torch.Tensor:
        rows = torch.zeros((GLOO_ROOMS, 4), dtype=torch.int64)
        with self._lock:
            for i, s in enumerate(list(self._table.values())[:GLOO_ROOMS]):
                rows[i] = torch.tensor([s.transfer, s.state, _REASONS.index(s.reason), s.digest])
        return rows

    def _run(self) -> None:
        import torch.distributed as dist

        gathered = [torch.zeros((GLOO_ROOMS, 4), dtype=torch.int64) for _ in range(self._world)]
        while not self._stop.is_set():
            try:
                dist.all_gather(gathered, self._rows(), group=self._group)
            except Exception as exc:  # a rank died: the node is broken, its leader says so
                log.error("gloo agreement stopped: %s", exc)
                return
            busy = self._fold(gathered)
            if not busy:
                time.sleep(GLOO_IDLE_S)

    def _fold(self, gathered: list[torch.Tensor]) -> bool:
        views: dict[int, dict[int, RankView]] = {}
        for rank, rows in enumerate(gathered):
            for room, state, reason, digest in rows.tolist():
                if room:
                    views.setdefault(room, {})[rank] = RankView(RoomState(state), _REASONS[reason], digest)
        changes = []
        for room in sorted(views):
            if room in self._ended:
                continue
            agreed = node_verdict(views[room], self._world)
            if self._agreed.get(room) != agreed:
                self._agreed[room] = agreed
                changes.append((room, *agreed))
                if agreed[0].terminal:
                    del self._agreed[room]
                    self._ended.add(room)
                    with self._lock:
                        self._table.pop(room, None)
        if changes:
            self._loop.call_soon_threadsafe(self._apply, changes)
        return bool(views)

    def _apply(self, changes: list[tuple[int, RoomState, str | None]]) -> None:
        for room, state, reason in changes:
            self.on_agreed(protocol.TransferId(room), state, reason)  # read back from a tensor

    def close(self) -> None:
        self._stop.set()
