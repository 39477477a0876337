"""What the bootstrap tells the nodes' leaders, gathered over one turn of its event loop and sent
as one ``protocol.Assignments`` a node.

Under load one turn places several rooms (the answers to earlier rooms come back together, and
so do the next requests), and every ZMQ message costs a wake-up of a thread on both ends: on a
small host those wake-ups were the bootstrap's largest single cost.
"""

import asyncio
import dataclasses
from collections.abc import Callable

from shared import protocol
from shared.zmq_io import PushSockets

# Prompts are most of a message's bytes: this many tokens stay far below a receiver's body limit.
MAX_TOKENS_PER_MESSAGE = 100_000


@dataclasses.dataclass
class _Message:
    prefill_rooms: list[protocol.PrefillRoom] = dataclasses.field(default_factory=list)
    decode_rooms: list[protocol.DecodeRoom] = dataclasses.field(default_factory=list)
    aborts: list[protocol.AbortRoom] = dataclasses.field(default_factory=list)
    room_ids: list[int] = dataclasses.field(default_factory=list)  # the bootstrap's ids of those rooms
    tokens: int = 0

    def full(self, tokens: int) -> bool:
        rooms = len(self.prefill_rooms) + len(self.decode_rooms)
        return rooms > 0 and (
            rooms >= protocol.MAX_ASSIGNMENTS or self.tokens + tokens > MAX_TOKENS_PER_MESSAGE
        )


class Outbox:
    def __init__(self, push: PushSockets, on_lost: Callable[[list[int]], object]):
        """``on_lost(room_ids)``: rooms whose assignment could not be queued to their node."""
        self._push = push
        self._on_lost = on_lost
        self._pending: dict[tuple[str, str], tuple[protocol.PeerRank, list[_Message]]] = {}

    def room(
        self, leader: protocol.PeerRank, msg: protocol.PrefillRoom | protocol.DecodeRoom, room_id: int
    ) -> None:
        tokens = len(msg.input_ids) if isinstance(msg, protocol.PrefillRoom) else 1
        messages = self._messages(leader)
        if messages[-1].full(tokens):
            messages.append(_Message())
        last = messages[-1]
        if isinstance(msg, protocol.PrefillRoom):
            last.prefill_rooms.append(msg)
        else:
            last.decode_rooms.append(msg)
        last.room_ids.append(room_id)
        last.tokens += tokens

    def abort(self, leader: protocol.PeerRank, msg: protocol.AbortRoom) -> None:
        messages = self._messages(leader)
        if len(messages[-1].aborts) >= protocol.MAX_ASSIGNMENTS:
            messages.append(_Message())
        messages[-1].aborts.append(msg)

    def _messages(self, leader: protocol.PeerRank) -> list[_Message]:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        key = (leader.zmq_endpoint, leader.public_key)
        if key not in self._pending:
            self._pending[key] = (leader, [_Message()])
        return self._pending[key][1]

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for leader, messages in pending.values():
            for m in messages:
                frames = protocol.encode(protocol.Assignments(m.prefill_rooms, m.decode_rooms, m.aborts))
                if not self._push.send(leader.zmq_endpoint, leader.public_key, frames) and m.room_ids:
                    self._on_lost(m.room_ids)
