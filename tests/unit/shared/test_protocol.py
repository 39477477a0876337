"""The wire codec: every message kind survives a round trip, and anything else is a typed error."""

import struct

import msgspec
import pytest

from shared.errors import FrameTooLarge, MalformedFrame, UnknownMessageType, VersionMismatch
from shared.wire import protocol

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a Z85 public key, 40 characters
PEER = protocol.PeerRank(
    rank=1,
    session_id="127.0.0.1:1234",
    zmq_endpoint="tcp://127.0.0.1:5555",
    public_key=KEY,
    kv_head_start=2,
    kv_head_count=2,
)
STATE = protocol.RankState(transfer=5, state=3, reason=None, digest=(1 << 32) - 1)
MESSAGES: list[protocol.Message] = [
    protocol.PrefillRoom(transfer=1, input_ids=[1, 2, 3], decode_node="d", decode_ranks=[PEER]),
    protocol.DecodeRoom(
        transfer=protocol.MAX_ROOM_ID,
        prompt_len=3,
        max_new_tokens=4,
        prefill_node="p",
        prefill_ranks=[PEER, msgspec.structs.replace(PEER, rank=0, public_key="", kv_head_start=0)],
        stop=["\n\n", "END"],
        stream=True,
    ),
    protocol.AbortRoom(transfer=5, rank=0, reason="aborted"),
    protocol.AbortRoom(transfer=5, rank=3, reason="peer_lost", peer_gone=True),
    protocol.RevokeLease(transfer=5, rank=1, reason="aux_timeout"),
    protocol.Assignments(
        prefill_rooms=[
            protocol.PrefillRoom(transfer=6, input_ids=[1, 2], decode_node="d", decode_ranks=[PEER])
        ],
        aborts=[protocol.AbortRoom(transfer=5, rank=0, reason="aborted")],
    ),
    protocol.TransferRequest(
        transfer=5,
        rank=0,
        decode_rank=1,
        kv_base_ptr=1 << 40,
        num_pages=10,
        page_bytes=4096,
        page_indices=[0, 1, 7],
        aux_slot=3,
    ),
    protocol.TransferRequests(
        [
            protocol.TransferRequest(
                transfer=6,
                rank=0,
                decode_rank=0,
                kv_base_ptr=0,
                num_pages=4,
                page_bytes=64,
                page_indices=[2],
                aux_slot=0,
            )
        ]
    ),
    protocol.TransferAccepted(transfer=5, rank=0, prefill_rank=1),
    protocol.TransferStarted(transfer=5, rank=0, prefill_rank=1),
    protocol.RoomReleased(transfer=5, rank=0, prefill_rank=0, reason="aborted"),
    protocol.RoomReports(
        node_id="n",
        reports=[
            protocol.RoomStatus(
                transfer=5,
                state=4,
                timestamps={"SUCCESS": 1.5},
                output_ids=[1],
                timings={"decode_s": 0.25},
                outcome="completed",
                finish_reason="stop",
            )
        ],
    ),
    protocol.RoomTokens(node_id="n", chunks=[protocol.TokenChunk(transfer=5, offset=3, tokens=[65, 66])]),
    protocol.RankStates(
        rank=2, states=[STATE, protocol.RankState(transfer=6, state=0, reason="aux_timeout")]
    ),
    protocol.RankAgreed(states=[STATE]),
    protocol.RankHealth(
        rank=1,
        free_pages=10,
        total_pages=16,
        free_aux_slots=3,
        total_aux_slots=4,
        rooms_in_flight=1,
        fenced_rooms=0,
    ),
    protocol.RankReady(peer=PEER),
]
DONE = protocol.DoneAux(
    transfer=5,
    rank=0,
    prefill_rank=1,
    aux_slot=3,
    pages_written=2,
    bytes_written=8192,
    completed_at=12.5,
    digests=[INT64_MIN, -1, 0, INT64_MAX],
)


def header(version=protocol.PROTOCOL_VERSION, kind=protocol.Kind.ABORT_ROOM, magic=protocol.MAGIC):
    return struct.pack("!4sHB", magic, version, kind)


def frames_of(kind: protocol.Kind, body: dict) -> list[bytes]:
    return [header(kind=kind), msgspec.msgpack.encode(body)]


def test_every_kind_has_a_round_trip_case():
    assert {type(m) for m in MESSAGES} | {protocol.DoneAux} == set(protocol.KIND_OF)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = protocol.encode(msg)
    assert len(frames) == 2
    assert frames[0] == header(kind=protocol.KIND_OF[type(msg)])
    decoded, aux = protocol.decode(frames)
    assert decoded == msg and aux is None


def test_done_travels_with_aux_and_signed_digests():
    frames = protocol.encode(DONE, b"x" * 24)
    assert len(frames) == 3
    decoded, aux = protocol.decode(frames)
    assert isinstance(decoded, protocol.DoneAux)
    assert decoded == DONE and decoded.digests == [INT64_MIN, -1, 0, INT64_MAX]
    assert aux is not None and bytes(aux) == b"x" * 24
    # A done notice whose aux frame was cut off still tells the receiver the KV is done.
    assert protocol.decode(frames[:2]) == (DONE, None)
    without = protocol.DoneAux(**(msgspec.structs.asdict(DONE) | {"digests": None}))
    assert protocol.decode(protocol.encode(without, b"a")) == (without, memoryview(b"a"))


def test_aux_goes_with_done_and_only_with_it():
    with pytest.raises(ValueError):
        protocol.encode(DONE)
    with pytest.raises(ValueError):
        protocol.encode(MESSAGES[0], b"aux")


ABORT = {"transfer": 5, "rank": 0, "reason": "x"}
BODY = msgspec.msgpack.encode(ABORT)
DONE_BODY = msgspec.structs.asdict(DONE)
REQUEST_BODY = msgspec.structs.asdict(next(m for m in MESSAGES if isinstance(m, protocol.TransferRequest)))
PEER_BODY = msgspec.structs.asdict(PEER)
STATES_BODY = {"rank": 0, "states": [{"transfer": 5, "state": 1}]}


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        pytest.param([], MalformedFrame, id="no frames"),
        pytest.param([header()], MalformedFrame, id="header only"),
        pytest.param([b"KVR", BODY], MalformedFrame, id="short header"),
        pytest.param([header() + b"x", BODY], MalformedFrame, id="long header"),
        pytest.param([header(magic=b"XXXX"), BODY], MalformedFrame, id="bad magic"),
        pytest.param([header(version=2), BODY], VersionMismatch, id="version 2"),
        pytest.param(
            [header(version=protocol.PROTOCOL_VERSION + 1), BODY], VersionMismatch, id="next version"
        ),
        pytest.param([header(version=0), b"\xff\xff"], VersionMismatch, id="version checked before body"),
        pytest.param([header(kind=99), BODY], UnknownMessageType, id="kind 99"),
        pytest.param([header(kind=0), BODY], UnknownMessageType, id="kind 0"),
        pytest.param([header(), BODY, b"extra"], MalformedFrame, id="third frame on abort"),
        pytest.param(
            [*frames_of(protocol.Kind.DONE_AUX, DONE_BODY), b"", b""], MalformedFrame, id="four frames"
        ),
        pytest.param([header(), b"\xc1garbage"], MalformedFrame, id="undecodable body"),
        pytest.param([header(), BODY[:-2]], MalformedFrame, id="truncated body"),
        pytest.param(
            frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"transfer": 0}), MalformedFrame, id="transfer 0"
        ),
        pytest.param(
            frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"transfer": 1 << 53}),
            MalformedFrame,
            id="transfer 2**53",
        ),
        pytest.param(
            frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"transfer": 1 << 63}),
            MalformedFrame,
            id="transfer 2**63",
        ),
        pytest.param(
            frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"transfer": -3}), MalformedFrame, id="transfer<0"
        ),
        pytest.param(
            frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"transfer": "3"}),
            MalformedFrame,
            id="transfer string",
        ),
        pytest.param(frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"rank": 999}), MalformedFrame, id="rank"),
        pytest.param(
            frames_of(protocol.Kind.ABORT_ROOM, {"transfer": 5, "rank": 0}),
            MalformedFrame,
            id="missing field",
        ),
        pytest.param(
            frames_of(protocol.Kind.DONE_AUX, DONE_BODY | {"digests": [1 << 63]}),
            MalformedFrame,
            id="digest above int64",
        ),
        pytest.param(
            frames_of(protocol.Kind.RANK_STATES, STATES_BODY | {"states": []}),
            MalformedFrame,
            id="no states",
        ),
        pytest.param(
            frames_of(protocol.Kind.RANK_STATES, {"rank": 0, "states": [{"transfer": 5, "state": 5}]}),
            MalformedFrame,
            id="state above SUCCESS",
        ),
        pytest.param(
            frames_of(
                protocol.Kind.RANK_AGREED, {"states": [{"transfer": 5, "state": 4, "digest": 1 << 32}]}
            ),
            MalformedFrame,
            id="record digest above uint32",
        ),
        pytest.param(
            frames_of(protocol.Kind.RANK_READY, {"peer": PEER_BODY | {"kv_head_count": 0}}),
            MalformedFrame,
            id="no heads",
        ),
        pytest.param(
            frames_of(protocol.Kind.RANK_READY, {"peer": PEER_BODY | {"public_key": "k" * 41}}),
            MalformedFrame,
            id="key too long",
        ),
        pytest.param(
            frames_of(protocol.Kind.TRANSFER_REQUEST, REQUEST_BODY | {"page_indices": [1, -1]}),
            MalformedFrame,
            id="negative page index",
        ),
        pytest.param([header(), b"\x00" * (protocol.MAX_BODY_BYTES + 1)], FrameTooLarge, id="body"),
        pytest.param(
            [*frames_of(protocol.Kind.DONE_AUX, DONE_BODY), b"\x00" * (protocol.MAX_BODY_BYTES + 1)],
            FrameTooLarge,
            id="aux frame",
        ),
    ],
)
def test_malformed_frames_raise_typed_errors(frames, error):
    with pytest.raises(error):
        protocol.decode(frames)


@pytest.mark.parametrize("transfer", [1, 2, protocol.MAX_ROOM_ID])
def test_transfer_ids_up_to_2_53_minus_1_are_accepted(transfer):
    """The edges of the room id range a JSON tool can hold exactly."""
    assert protocol.MAX_ROOM_ID == (1 << 53) - 1
    msg, _ = protocol.decode(frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"transfer": transfer}))
    assert isinstance(msg, protocol.AbortRoom) and msg.transfer == transfer


def test_peek_transfer_for_log_lines():
    assert protocol.peek_transfer([header(), BODY]) == 5
    assert protocol.peek_transfer([header(), b"\xc1"]) is None
    assert protocol.peek_transfer([header()]) is None
    assert protocol.peek_transfer([header(), msgspec.msgpack.encode([5])]) is None  # not a map
    assert protocol.peek_transfer([header(), msgspec.msgpack.encode({"transfer": "5"})]) is None


def test_done_aux_is_told_from_its_header_alone():
    assert protocol.is_done_aux(protocol.encode(DONE, b"aux"))
    assert protocol.is_done_aux([header(kind=protocol.Kind.DONE_AUX), b"\xc1"])  # body not looked at
    assert not protocol.is_done_aux(
        protocol.encode(protocol.TransferStarted(transfer=5, rank=0, prefill_rank=0))
    )
    assert not protocol.is_done_aux([b"short"])
    assert not protocol.is_done_aux([header(kind=protocol.Kind.DONE_AUX) + b"x", b""])
    assert not protocol.is_done_aux([b"\x06", b""])  # a frame of another length that ends in the kind


def test_a_hand_built_v2_body_decodes():
    """The field names on the wire, as a peer of this version writes them."""
    msg, _ = protocol.decode(frames_of(protocol.Kind.ABORT_ROOM, ABORT | {"peer_gone": True}))
    assert msg == protocol.AbortRoom(transfer=5, rank=0, reason="x", peer_gone=True)
    msg, _ = protocol.decode(frames_of(protocol.Kind.RANK_READY, {"peer": PEER_BODY}))
    assert msg == protocol.RankReady(peer=PEER)
    assert set(PEER_BODY) == {
        "rank",
        "session_id",
        "zmq_endpoint",
        "public_key",
        "kv_head_start",
        "kv_head_count",
    }
