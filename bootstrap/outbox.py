"""What the bootstrap tells the nodes' leaders: the rooms it places on a node and its aborts for
it, gathered over one turn of its event loop (``shared.wire.per_turn``) into ``protocol.Assignments``.
"""

from collections.abc import Callable

from shared.wire import protocol
from shared.wire.per_turn import PerTurn, chunks
from shared.wire.zmq_io import PushSockets

# Prompts are most of a message's bytes: this many tokens stay far below a receiver's body limit.
MAX_TOKENS_PER_MESSAGE = 100_000

# A message, with the id of its room (0 for an abort: it names only a transfer).
Item = tuple[protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom, protocol.RoomId]


def _tokens(item: Item) -> int:
    msg = item[0]
    return len(msg.input_ids) if isinstance(msg, protocol.PrefillRoom) else 1


class Outbox:
    def __init__(self, push: PushSockets, on_lost: Callable[[list[protocol.RoomId]], object]):
        """``on_lost(room_ids)``: rooms whose assignment could not be queued to their node."""
        self._push = push
        self._on_lost = on_lost
        self._turn: PerTurn[Item] = PerTurn(self._send)

    def room(
        self,
        leader: protocol.PeerRank,
        msg: protocol.PrefillRoom | protocol.DecodeRoom,
        room_id: protocol.RoomId,
    ) -> None:
        self._turn.add(leader, (msg, room_id))

    def abort(self, leader: protocol.PeerRank, msg: protocol.AbortRoom) -> None:
        self._turn.add(leader, (msg, protocol.RoomId(0)))

    async def flushed(self) -> None:
        """Until this turn's assignments have been queued to their nodes."""
        await self._turn.flushed()

    def _send(self, leader: protocol.PeerRank, items: list[Item]) -> None:
        # A message's rooms are taken before its aborts: an abort never names a room that
        # comes after it (a room placed again gets a new transfer id).
        for run in chunks(items, _tokens, protocol.MAX_ASSIGNMENTS, MAX_TOKENS_PER_MESSAGE):
            msgs = [msg for msg, _ in run]
            batch = protocol.Assignments(
                [m for m in msgs if isinstance(m, protocol.PrefillRoom)],
                [m for m in msgs if isinstance(m, protocol.DecodeRoom)],
                [m for m in msgs if isinstance(m, protocol.AbortRoom)],
            )
            sent = self._push.send(leader.zmq_endpoint, leader.public_key, protocol.encode(batch))
            lost = [room_id for msg, room_id in run if not isinstance(msg, protocol.AbortRoom)]
            if not sent and lost:
                self._on_lost(lost)
