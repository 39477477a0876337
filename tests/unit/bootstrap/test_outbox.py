"""The bootstrap's outbox: one message a node and turn, split before a receiver's limits."""

import asyncio

from bootstrap.outbox import MAX_TOKENS_PER_MESSAGE, Outbox
from shared.wire import protocol

PREFILL = protocol.PeerRank(0, "p:1", "tcp://127.0.0.1:1", "", 0, 4)
DECODE = protocol.PeerRank(0, "d:1", "tcp://127.0.0.1:2", "", 0, 4)


class Push:
    def __init__(self, refuse: str = ""):
        self.sent: list[tuple[str, protocol.Assignments]] = []
        self.refuse = refuse

    def send(self, endpoint: str, server_key: str, frames: list[bytes]) -> bool:
        if endpoint == self.refuse:
            return False
        msg, _ = protocol.decode(frames)
        assert isinstance(msg, protocol.Assignments)
        self.sent.append((endpoint, msg))
        return True


def prefill_room(room: int, tokens: int = 4) -> protocol.PrefillRoom:
    return protocol.PrefillRoom(room, [65] * tokens, "decode-0", [DECODE])


def decode_room(room: int) -> protocol.DecodeRoom:
    return protocol.DecodeRoom(room, 4, 2, "prefill-0", [PREFILL])


def test_one_message_a_node_and_turn_rooms_before_aborts():
    push, lost = Push(), []
    outbox = Outbox(push, lost.extend)  # type: ignore[arg-type]

    async def turn():
        outbox.abort(PREFILL, protocol.AbortRoom(9, 0, "aborted"))
        for room in (1, 2, 3):
            outbox.room(PREFILL, prefill_room(room), room)
            outbox.room(DECODE, decode_room(room), room)
        assert push.sent == []  # nothing leaves before the turn ends
        await asyncio.sleep(0)

    asyncio.run(turn())
    by_node = dict(push.sent)
    assert len(push.sent) == 2
    assert [r.transfer for r in by_node[PREFILL.zmq_endpoint].prefill_rooms] == [1, 2, 3]
    assert [a.transfer for a in by_node[PREFILL.zmq_endpoint].aborts] == [9]
    assert [r.transfer for r in by_node[DECODE.zmq_endpoint].decode_rooms] == [1, 2, 3]
    assert lost == []


def test_a_turn_past_the_limits_is_split_in_order():
    push = Push()
    outbox = Outbox(push, lambda ids: None)  # type: ignore[arg-type]
    big = MAX_TOKENS_PER_MESSAGE // 2 + 1

    async def turn():
        for room in (1, 2, 3):
            outbox.room(PREFILL, prefill_room(room, big), room)
        for room in range(10, 10 + protocol.MAX_ASSIGNMENTS + 1):
            outbox.room(DECODE, decode_room(room), room)
        await asyncio.sleep(0)

    asyncio.run(turn())
    prefill = [m for e, m in push.sent if e == PREFILL.zmq_endpoint]
    assert [[r.transfer for r in m.prefill_rooms] for m in prefill] == [[1], [2], [3]]
    decode = [m for e, m in push.sent if e == DECODE.zmq_endpoint]
    assert [len(m.decode_rooms) for m in decode] == [protocol.MAX_ASSIGNMENTS, 1]
    for _, m in push.sent:  # each within what a receiver decodes
        assert len(protocol.encode(m)[1]) <= protocol.MAX_BODY_BYTES


def test_rooms_that_could_not_be_queued_are_reported_lost():
    push, lost = Push(refuse=DECODE.zmq_endpoint), []
    outbox = Outbox(push, lost.extend)  # type: ignore[arg-type]

    async def turn():
        for room in (1, 2):
            outbox.room(PREFILL, prefill_room(room), room)
            outbox.room(DECODE, decode_room(room), room)
        await asyncio.sleep(0)

    asyncio.run(turn())
    assert lost == [1, 2]
    assert len(push.sent) == 1


def test_a_placement_can_wait_until_its_turn_was_sent():
    push = Push()
    outbox = Outbox(push, lambda ids: None)  # type: ignore[arg-type]

    async def place():
        outbox.room(PREFILL, prefill_room(1), 1)
        await outbox.flushed()
        return len(push.sent)

    async def turn():
        return await asyncio.gather(place(), place())

    assert asyncio.run(turn()) == [1, 1]  # both answered after the one message left
    assert len(push.sent[0][1].prefill_rooms) == 2
