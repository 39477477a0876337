import struct

import msgspec
import pytest

from shared import protocol
from shared.errors import FrameTooLarge, MalformedFrame, UnknownMessageType, VersionMismatch

PEER = protocol.PeerRank(rank=0, session_id="127.0.0.1:1234", zmq_endpoint="tcp://127.0.0.1:5555")
MESSAGES = [
    protocol.PrefillRoom(
        room=1, rank=0, token="t", input_ids=[1, 2, 3], decode_node="d", decode_ranks=[PEER]
    ),
    protocol.DecodeRoom(
        room=(1 << 63) - 1,
        token="t",
        rank=0,
        prompt_len=3,
        max_new_tokens=4,
        prefill_node="p",
        prefill_ranks=[PEER],
    ),
    protocol.AbortRoom(room=5, rank=0, token="t", reason="aborted"),
    protocol.TransferRequest(
        room=5,
        rank=0,
        decode_rank=0,
        session_id="h:1",
        kv_base_ptr=1 << 40,
        num_pages=10,
        page_bytes=4096,
        page_indices=[0, 1, 7],
        aux_slot=3,
        aux_endpoint="tcp://h:2",
    ),
    protocol.TransferAccepted(room=5, rank=0, prefill_rank=0),
    protocol.TransferStarted(room=5, rank=0, prefill_rank=0),
    protocol.RoomReleased(room=5, rank=0, prefill_rank=0, reason="aborted"),
    protocol.RoomReports(
        node_id="n",
        reports=[protocol.RoomStatus(room=5, state=4, timestamps={"SUCCESS": 1.5}, output_ids=[1])],
    ),
]
DONE = protocol.KvDone(
    room=5, rank=0, prefill_rank=0, aux_slot=3, pages_written=2, bytes_written=8192, completed_at=12.5
)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = protocol.encode(msg)
    assert len(frames) == 2
    decoded, aux = protocol.decode(frames)
    assert decoded == msg and aux is None


def test_done_travels_with_aux():
    frames = protocol.encode(DONE, b"x" * 20)
    decoded, aux = protocol.decode(frames)
    assert decoded == DONE and bytes(aux) == b"x" * 20
    # A done notice whose aux frame was cut off still tells the receiver the KV is done.
    assert protocol.decode(frames[:2]) == (DONE, None)
    with pytest.raises(ValueError):
        protocol.encode(DONE)
    with pytest.raises(ValueError):
        protocol.encode(MESSAGES[0], b"aux")


def header(version=protocol.PROTOCOL_VERSION, kind=protocol.Kind.ABORT_ROOM, magic=protocol.MAGIC):
    return struct.pack("!4sHB", magic, version, kind)


BODY = msgspec.msgpack.encode({"room": 5, "rank": 0, "token": "t", "reason": "x"})


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([], MalformedFrame),
        ([header()], MalformedFrame),
        ([b"KVR", BODY], MalformedFrame),
        ([header() + b"x", BODY], MalformedFrame),
        ([header(magic=b"XXXX"), BODY], MalformedFrame),
        ([header(version=2), BODY], VersionMismatch),
        ([header(version=0), b"\xff\xff"], VersionMismatch),
        ([header(kind=99), BODY], UnknownMessageType),
        ([header(kind=0), BODY], UnknownMessageType),
        ([header(), BODY, b"extra"], MalformedFrame),
        (
            [
                header(kind=protocol.Kind.DONE_AUX),
                msgspec.msgpack.encode(msgspec.structs.asdict(DONE)),
                b"",
                b"",
            ],
            MalformedFrame,
        ),
        ([header(), b"\xc1garbage"], MalformedFrame),
        ([header(), BODY[:-2]], MalformedFrame),
        (
            [header(), msgspec.msgpack.encode({"room": 0, "rank": 0, "token": "t", "reason": "x"})],
            MalformedFrame,
        ),
        (
            [header(), msgspec.msgpack.encode({"room": 1 << 63, "rank": 0, "token": "t", "reason": "x"})],
            MalformedFrame,
        ),
        (
            [header(), msgspec.msgpack.encode({"room": -3, "rank": 0, "token": "t", "reason": "x"})],
            MalformedFrame,
        ),
        (
            [header(), msgspec.msgpack.encode({"room": 3, "rank": 999, "token": "t", "reason": "x"})],
            MalformedFrame,
        ),
        (
            [header(), msgspec.msgpack.encode({"room": "3", "rank": 0, "token": "t", "reason": "x"})],
            MalformedFrame,
        ),
        ([header(), b"\x00" * (protocol.MAX_BODY_BYTES + 1)], FrameTooLarge),
    ],
)
def test_malformed_frames_raise_typed_errors(frames, error):
    with pytest.raises(error):
        protocol.decode(frames)


def test_negative_page_index_is_rejected():
    body = msgspec.structs.asdict(MESSAGES[3]) | {"page_indices": [1, -1]}
    frames = [header(kind=protocol.Kind.TRANSFER_REQUEST), msgspec.msgpack.encode(body)]
    with pytest.raises(MalformedFrame):
        protocol.decode(frames)


def test_peek_room_for_log_lines():
    assert protocol.peek_room([header(), BODY]) == 5
    assert protocol.peek_room([header(), b"\xc1"]) is None
    assert protocol.peek_room([header()]) is None


def test_done_aux_is_told_from_its_header_alone():
    done = protocol.KvDone(
        room=5, rank=0, prefill_rank=0, aux_slot=1, pages_written=1, bytes_written=8, completed_at=1.0
    )
    assert protocol.is_done_aux(protocol.encode(done, b"aux"))
    assert not protocol.is_done_aux(protocol.encode(protocol.TransferStarted(room=5, rank=0, prefill_rank=0)))
    assert not protocol.is_done_aux([b"short"])
