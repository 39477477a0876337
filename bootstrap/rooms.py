"""The bootstrap's view of every room: placement, the agreed state, the result."""

import asyncio
import collections
import logging
import secrets

from bootstrap.registry import Node
from shared import protocol
from shared.model import decode_text
from shared.room import Room
from shared.states import FailureReason, RoomState, forward_path

log = logging.getLogger(__name__)


class RoomRecord(Room):
    """A room as the bootstrap sees it: its placement, the decode's state, the result."""

    def __init__(self, room: int, input_ids: list[int], max_new_tokens: int, prefill: Node, decode: Node):
        super().__init__(room)
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.prefill = prefill
        self.decode = decode
        self.node_states: dict[str, dict[str, object]] = {}
        self.finished = asyncio.Event()

    def view(self) -> dict[str, object]:
        return {
            "room": self.id,
            "state": self.state.name,
            "reason": self.reason,
            "finished": self.finished.is_set(),
            "prompt_tokens": len(self.input_ids),
            "max_new_tokens": self.max_new_tokens,
            "output_ids": self.output_ids,
            "text": decode_text(self.output_ids) if self.output_ids is not None else None,
            "prefill": {
                "node_id": self.prefill.id,
                "session_ids": [r.session_id for r in self.prefill.reg.ranks],
            },
            "decode": {
                "node_id": self.decode.id,
                "session_ids": [r.session_id for r in self.decode.reg.ranks],
            },
            "node_states": self.node_states,
            "timestamps": self.timestamps,
            "timings": self.timings,
        }


class RoomBook:
    def __init__(self, history: int):
        self.rooms: collections.OrderedDict[int, RoomRecord] = collections.OrderedDict()
        self.history = history

    def new_id(self) -> int:
        """Unique, non-zero, below 2**63: 0 is never a room."""
        while True:
            room = secrets.randbits(63)
            if room and room not in self.rooms:
                return room

    def add(self, record: RoomRecord) -> None:
        self.rooms[record.id] = record
        record.prefill.rooms.add(record.id)
        record.decode.rooms.add(record.id)
        self._trim()

    def _trim(self) -> None:
        """Forget the oldest finished rooms past the history size; O(1) per room added.

        A room still in flight at the head holds trimming back until it finishes.
        """
        while len(self.rooms) > self.history:
            oldest = next(iter(self.rooms.values()))
            if not oldest.finished.is_set():
                return
            self.rooms.popitem(last=False)

    def in_flight(self) -> list[RoomRecord]:
        return [r for r in self.rooms.values() if not r.state.terminal]

    def fail(self, record: RoomRecord, reason: str) -> bool:
        """End the room FAILED unless it already ended; True if this call ended it."""
        if not record.fail(reason):
            return False
        self._finish(record)
        return True

    def _finish(self, record: RoomRecord) -> None:
        record.prefill.rooms.discard(record.id)
        record.decode.rooms.discard(record.id)
        record.finished.set()
        self._trim()

    def apply(self, record: RoomRecord, role: str, report: protocol.RoomStatus) -> list[Node]:
        """Fold a node's report into the room; returns nodes that must be told to abort."""
        state = RoomState(report.state)
        ts = report.timestamps.get(state.name)
        record.node_states[role] = {"state": state.name, "reason": report.reason, "ts": ts}
        record.timings.update(report.timings)
        if state is RoomState.FAILED:
            if self.fail(record, report.reason or f"{role}_failed"):
                return [record.decode if role == "prefill" else record.prefill]
            return []
        if role == "decode":
            for step in forward_path(record.state, state):
                record.advance(step, ts=report.timestamps.get(step.name))
        if role == "decode" and report.output_ids is not None and record.state is RoomState.SUCCESS:
            record.output_ids = report.output_ids
            if report.reason:
                record.reason = report.reason
            self._finish(record)
        elif role == "decode" and report.reason == FailureReason.DECODE_FAILED:
            record.reason = report.reason
            self._finish(record)
        return []
