"""The bootstrap's view of every room: placement, the agreed state, the outcome, the result."""

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Callable

from bootstrap.registry import Node
from shared import protocol
from shared.room import Room
from shared.states import FailureReason, RoomState, forward_path

log = logging.getLogger(__name__)


class RoomRecord(Room):
    """A room as the bootstrap sees it.

    ``state`` is the transfer's, from the decode node's reports: SUCCESS once
    the KV and aux landed and were validated there. ``outcome`` is the
    request's end after that: "completed" with the output, or "failed" with a
    reason. The view's ``state`` is FAILED for a failed outcome.
    """

    def __init__(
        self,
        room: int,
        input_ids: list[int],
        max_new_tokens: int,
        prefill: Node,
        decode: Node,
        detokenize: Callable[[list[int]], str],
    ):
        super().__init__(room)
        self.input_ids = input_ids
        self.max_new_tokens = max_new_tokens
        self.prefill = prefill
        self.decode = decode
        self._detokenize = detokenize
        self.node_states: dict[str, dict[str, object]] = {}
        self.placed_at = time.monotonic()
        self.done = asyncio.Event()
        # Tokens streamed as the decode makes them, and a wake-up for whoever reads them.
        self.streamed: list[int] = []
        self.progress = asyncio.Event()

    def view(self) -> dict[str, object]:
        return {
            **super().view(),
            "finished": self.done.is_set(),
            "prompt_tokens": len(self.input_ids),
            "max_new_tokens": self.max_new_tokens,
            "text": self._detokenize(self.output_ids) if self.output_ids is not None else None,
            "prefill": {
                "node_id": self.prefill.id,
                "session_ids": [r.session_id for r in self.prefill.reg.ranks],
            },
            "decode": {
                "node_id": self.decode.id,
                "session_ids": [r.session_id for r in self.decode.reg.ranks],
            },
            "node_states": self.node_states,
        }

    def add_tokens(self, offset: int, tokens: list[int]) -> None:
        """Streamed tokens, in order; a chunk that repeats or skips ahead is ignored."""
        if offset == len(self.streamed):
            self.streamed += tokens
            self.progress.set()

    def wake(self) -> None:
        self.progress.set()


class RoomBook:
    def __init__(self, history: int):
        self.rooms: collections.OrderedDict[int, RoomRecord] = collections.OrderedDict()
        self.history = history

    def new_id(self) -> int:
        """Unique, non-zero, exact in a float64: 0 is never a room, and JSON tools keep every digit."""
        while True:
            room = secrets.randbelow(protocol.MAX_ROOM_ID) + 1
            if room not in self.rooms:
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
            if not oldest.done.is_set():
                return
            self.rooms.popitem(last=False)

    def in_flight(self) -> list[RoomRecord]:
        return [r for r in self.rooms.values() if not r.done.is_set()]

    def fail(self, record: RoomRecord, reason: str) -> bool:
        """End the room FAILED (or its outcome failed, once the transfer succeeded); True if this ended it."""
        if record.done.is_set():
            return False
        if record.state is RoomState.SUCCESS:
            record.end("failed", reason)
        else:
            record.fail(reason)
        self._finish(record)
        return True

    def _finish(self, record: RoomRecord) -> None:
        record.prefill.rooms.discard(record.id)
        record.decode.rooms.discard(record.id)
        record.done.set()
        record.wake()
        self._trim()

    def apply(self, record: RoomRecord, role: str, report: protocol.RoomStatus) -> list[Node]:
        """Fold a node's report into the room; returns nodes that must be told to abort."""
        state = RoomState(report.state)
        ts = report.timestamps.get(state.name)
        record.node_states[role] = {
            "state": state.name,
            "reason": report.reason,
            "outcome": report.outcome,
            "ts": ts,
        }
        record.timings.update(report.timings)
        if record.done.is_set():
            return []
        if state is RoomState.FAILED:
            if record.state is not RoomState.SUCCESS and self.fail(record, report.reason or f"{role}_failed"):
                return [record.decode if role == "prefill" else record.prefill]
            return []
        if role != "decode":
            return []
        # Only the decode node's report moves the room: SUCCESS is what it validated.
        for step in forward_path(record.state, state):
            record.advance(step, ts=report.timestamps.get(step.name))
        if record.state is RoomState.SUCCESS and report.outcome is not None:
            if report.outcome == "completed":
                record.output_ids = report.output_ids or []
                record.finish_reason = report.finish_reason
                record.end("completed")
            else:
                record.end("failed", report.reason or FailureReason.DECODE_FAILED)
            self._finish(record)
        return []
