"""A room's state on one service: the only place a state is changed."""

import collections
import logging
import time
from collections.abc import Callable
from typing import NewType

from shared.room.states import FailureReason, RoomState, check_transition, forward_path

log = logging.getLogger(__name__)

# A placement of a room, the only id a node knows (the client's room id stays with the
# bootstrap): a room's first placement has the room's id, one placed again a new one.
TransferId = NewType("TransferId", int)


def _ignore(room: "Room") -> None:
    pass


class Room:
    def __init__(self, room_id: TransferId, on_change: Callable[["Room"], None] = _ignore):
        self.id = room_id
        self.state = RoomState.BOOTSTRAPPING
        self.reason: str | None = None
        self.timestamps: dict[str, float] = {RoomState.BOOTSTRAPPING.name: time.time()}
        self.timings: dict[str, float] = {}
        self.output_ids: list[int] | None = None
        # The request's end once the transfer succeeded: "completed", or "failed" with ``reason``.
        self.outcome: str | None = None
        self.finish_reason: str | None = None  # "stop" or "length", once completed
        self._on_change = on_change
        log.info("room=%d %s", room_id, self.state.name, extra={"room": room_id})

    def advance(self, new: RoomState, reason: str | None = None, ts: float | None = None) -> None:
        """Move to ``new`` if the table allows it; IllegalTransition otherwise.

        ``ts`` is when the move happened, if not now (a state a peer reported).
        """
        self.state = check_transition(self.id, self.state, new)
        self.reason = reason
        self.timestamps[new.name] = ts or time.time()
        if reason:
            log.info("room=%d %s reason=%s", self.id, new.name, reason, extra={"room": self.id})
        else:
            log.info("room=%d %s", self.id, new.name, extra={"room": self.id})
        self._on_change(self)

    def advance_to(self, target: RoomState) -> None:
        """Move forward to ``target`` through every state in between; no-op if not ahead."""
        for state in forward_path(self.state, target):
            self.advance(state)

    def fail(self, reason: FailureReason | str) -> bool:
        """End the room FAILED unless it already ended; True if this call ended it."""
        if self.state.terminal:
            return False
        self.advance(RoomState.FAILED, str(reason))
        return True

    def end(self, outcome: str, reason: str | None = None) -> None:
        """The request ended after a successful transfer: its outcome, apart from the transfer state."""
        assert self.state is RoomState.SUCCESS and self.outcome is None, (self.state, self.outcome)
        self.outcome, self.reason = outcome, reason
        if reason:
            log.info("room=%d %s reason=%s", self.id, outcome, reason, extra={"room": self.id})
        self._on_change(self)

    @property
    def finished(self) -> bool:
        return self.state is RoomState.FAILED or self.outcome is not None


class RoomTable:
    """Live rooms, plus a bounded memory of finished ones for late messages and lookups."""

    def __init__(self, remember: int = 4096):
        self.live: dict[TransferId, Room] = {}
        self.finished: collections.OrderedDict[TransferId, Room] = collections.OrderedDict()
        self._remember = remember

    def add(self, room: Room) -> None:
        self.live[room.id] = room

    def retire(self, room: Room) -> None:
        self.live.pop(room.id, None)
        self.finished[room.id] = room
        while len(self.finished) > self._remember:
            self.finished.popitem(last=False)

    def ended_unseen(self, room_id: TransferId, reason: str) -> Room:
        """A room never taken here, ended: an abort that overtook its assignment (a second
        bootstrap's), or an assignment refused. It is remembered as failed, so that an assignment
        of it that comes (again) is refused as a duplicate."""
        room = Room(room_id)
        room.fail(reason)
        self.retire(room)
        return room

    def find(self, room_id: TransferId) -> Room | None:
        return self.live.get(room_id) or self.finished.get(room_id)

    def states(self) -> list[RoomState]:
        return [room.state for room in self.live.values()]
