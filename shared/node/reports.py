"""Where rank 0 sends room reports and streamed tokens, and whose assignments it takes.

Reports and tokens go over ZMQ, CURVE-authenticated, to the report endpoint of the
bootstrap the node registered with (``shared.node.membership`` says which).
"""

import asyncio
from collections.abc import Callable, Collection

import msgspec

from shared.room.record import Room
from shared.wire import protocol
from shared.wire.registration import Bootstrap

# How long room state changes are gathered before they go to the bootstrap in one
# message. Progress, which no one waits on, waits PROGRESS_REPORT_DELAY_S: else it would
# wake the bootstrap in the middle of most KV writes. A room that reached SUCCESS or
# FAILED, or finished (what a client waits for), goes at the end of the loop's turn when
# no other room is in flight on the node; else REPORT_DELAY_S later, with the rooms that
# end meanwhile: under load one message carries many rooms, and a lone room waits for
# nothing. (Holding it only after a busy message instead cost 10% of the control plane's
# rooms/s at 8 in flight: the message that ends a burst then goes alone.)
REPORT_DELAY_S = 0.002
PROGRESS_REPORT_DELAY_S = 0.05
TOKEN_DELAY_S = 0.002

Send = Callable[[str, str, list[bytes]], bool]  # endpoint, its CURVE key, frames


def room_status(room: Room) -> protocol.RoomStatus:
    """The room's record, as its reports carry it."""
    return protocol.RoomStatus(
        transfer=room.id,
        state=int(room.state),
        reason=room.reason,
        timestamps=room.timestamps,
        timings=room.timings,
        output_ids=room.output_ids,
        outcome=room.outcome,
        finish_reason=room.finish_reason,
    )


def room_view(room: Room) -> dict[str, object]:
    """The room as its node's HTTP view shows it: its report's fields, the state as clients see it."""
    status = room_status(room)
    return msgspec.structs.asdict(status) | {"state": status.public_state, "transfer_state": room.state.name}


class BootstrapLink:
    def __init__(self, node_id: str, send: Send, loop: asyncio.AbstractEventLoop):
        self.node_id = node_id
        self._send = send
        self.loop = loop
        self.bootstrap_keys: frozenset[str] = frozenset()
        self.reporting_to: str | None = None  # the bootstrap's id
        self._endpoint = ("", "")  # its report endpoint and key
        self._pending_reports: dict[int, Room] = {}
        self._report_due = float("inf")  # loop time of the next flush; inf when none is set
        # Ids of the node's rooms in flight, set by its owner: while others are, a room that ended waits.
        self.live: Collection[int] = ()
        self._report_timer: asyncio.Handle | None = None
        self._pending_tokens: list[protocol.TokenChunk] = []

    def trust(self, keys: frozenset[str]) -> None:
        """The keys of the cluster's bootstraps: assignments are taken from these only."""
        self.bootstrap_keys = keys

    def report_to(self, bootstrap: Bootstrap) -> None:
        self.reporting_to = bootstrap.id
        self._endpoint = (bootstrap.report_endpoint, bootstrap.public_key)

    def is_bootstrap(self, sender: str | None) -> bool:
        """Whether ``sender`` is a bootstrap of our cluster (anyone, with security off)."""
        return sender is None or sender in self.bootstrap_keys

    # -- reports ----------------------------------------------------------------------

    def report(self, room: Room) -> None:
        """Tell the bootstrap where the room stands on this node.

        Changes are gathered for a moment and sent as one message, the latest
        state of each room with the time it entered every state: under load
        the bootstrap handles a few messages instead of one per transition.
        """
        self._pending_reports[room.id] = room
        now = self.loop.time()
        if room.finished or room.state.terminal:
            others = len(self.live) - (room.id in self.live)
            due = now + REPORT_DELAY_S if others else now
        else:
            due = now + PROGRESS_REPORT_DELAY_S
        self._schedule(due)

    def tokens(self, room: protocol.TransferId, offset: int, tokens: list[int]) -> None:
        self._pending_tokens.append(protocol.TokenChunk(room, offset, tokens))
        self._schedule(self.loop.time() + TOKEN_DELAY_S)

    def _schedule(self, due: float) -> None:
        if self._report_due <= due:
            return
        if self._report_timer is not None:
            self._report_timer.cancel()
        self._report_due = due
        self._report_timer = self.loop.call_at(due, self.flush)

    def flush(self) -> None:
        self._report_due = float("inf")
        self._report_timer = None
        if self.reporting_to is None:
            return  # kept until we know where reports go
        endpoint, key = self._endpoint
        chunks, self._pending_tokens = self._pending_tokens, []
        for start in range(0, len(chunks), protocol.MAX_REPORTS):
            msg = protocol.RoomTokens(self.node_id, chunks[start : start + protocol.MAX_REPORTS])
            self._send(endpoint, key, protocol.encode(msg))
        rooms = list(self._pending_reports.values())
        self._pending_reports.clear()
        for start in range(0, len(rooms), protocol.MAX_REPORTS):
            statuses = [room_status(room) for room in rooms[start : start + protocol.MAX_REPORTS]]
            self._send(endpoint, key, protocol.encode(protocol.RoomReports(self.node_id, statuses)))
