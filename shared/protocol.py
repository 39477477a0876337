"""Every ZMQ message kvroom sends, as typed structs, and the frame codec.

A message is a ZMQ multipart message: a 7-byte header frame
(magic ``KVRM``, protocol version u16, message kind u8), a msgpack body frame,
and for ``DONE_AUX`` a third frame holding the raw aux record. The header is
checked before the body is decoded, so a peer speaking another version is
rejected without parsing anything it sent.

A ``DONE_AUX`` that arrives with its aux frame cut off still decodes (the aux
comes back as None): the receiver learns the KV is done and keeps waiting for
the aux, which is the one state the aux timeout exists for.

Changelog
    1  first version: PREFILL_ROOM, DECODE_ROOM, ABORT_ROOM, TRANSFER_REQUEST,
       TRANSFER_ACCEPTED, TRANSFER_STARTED, DONE_AUX, ROOM_RELEASED, ROOM_REPORTS.
"""

import enum
import struct
from typing import Annotated, Any

import msgspec

from shared.errors import (
    FrameTooLarge,
    MalformedFrame,
    UnknownMessageType,
    VersionMismatch,
)

PROTOCOL_VERSION = 1
MAGIC = b"KVRM"
_HEADER = struct.Struct("!4sHB")
HEADER_BYTES = _HEADER.size
# Far above any legal body (a prompt at the token cap is well under 100 KiB).
MAX_BODY_BYTES = 1 << 20
# Upper bounds that keep a hostile frame from making us allocate or loop much.
MAX_RANKS = 64
MAX_PAGES_PER_ROOM = 1 << 16
MAX_TOKENS = 1 << 17
MAX_REPORTS = 1024

RoomId = Annotated[int, msgspec.Meta(gt=0, le=(1 << 63) - 1)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Endpoint = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# Room assignments and aborts carry the token the bootstrap hands out at registration,
# so a node takes them only from its own cluster.
Token64 = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Text = Annotated[str, msgspec.Meta(max_length=256)]


class Kind(enum.IntEnum):
    PREFILL_ROOM = 1
    DECODE_ROOM = 2
    ABORT_ROOM = 3
    TRANSFER_REQUEST = 4
    TRANSFER_STARTED = 5
    DONE_AUX = 6
    ROOM_RELEASED = 7
    ROOM_REPORTS = 8
    TRANSFER_ACCEPTED = 9


class PeerRank(msgspec.Struct, frozen=True):
    rank: Rank
    session_id: Endpoint
    zmq_endpoint: Endpoint


class PrefillRoom(msgspec.Struct, frozen=True):
    """Bootstrap -> each prefill rank: compute this prompt's KV for these decode ranks."""

    room: RoomId
    rank: Rank
    token: Token64
    input_ids: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
    decode_node: Text
    decode_ranks: Annotated[list[PeerRank], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]


class DecodeRoom(msgspec.Struct, frozen=True):
    """Bootstrap -> each decode rank: take a room whose KV comes from these prefill ranks."""

    room: RoomId
    rank: Rank
    token: Token64
    prompt_len: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    prefill_node: Text
    prefill_ranks: Annotated[list[PeerRank], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]


class AbortRoom(msgspec.Struct, frozen=True):
    """Bootstrap or peer -> a rank: end the room FAILED with ``reason``."""

    room: RoomId
    rank: Rank
    token: Token64
    reason: Text


class TransferRequest(msgspec.Struct, frozen=True):
    """Decode rank -> prefill rank: write the room's KV into these pages of mine."""

    room: RoomId
    rank: Rank  # the prefill rank addressed
    decode_rank: Rank
    session_id: Endpoint
    kv_base_ptr: NonNegative
    num_pages: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    page_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    page_indices: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_PAGES_PER_ROOM)]
    aux_slot: NonNegative
    aux_endpoint: Endpoint


class TransferAccepted(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank: the request is valid; the KV follows when computed."""

    room: RoomId
    rank: Rank  # the decode rank addressed
    prefill_rank: Rank


class TransferStarted(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank: the KV writes for the room have begun."""

    room: RoomId
    rank: Rank  # the decode rank addressed
    prefill_rank: Rank


class KvDone(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank, sent only after every KV write completed.

    Always travels with the aux record as the third frame of the same message.
    """

    room: RoomId
    rank: Rank  # the decode rank addressed
    prefill_rank: Rank
    aux_slot: NonNegative
    pages_written: NonNegative
    bytes_written: NonNegative
    completed_at: float  # wall clock when the last KV write completed, for aux latency


class RoomReleased(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank: I will not touch this room's pages again.

    ``reason`` says why the prefill gave the room up; empty if it had finished.
    """

    room: RoomId
    rank: Rank
    prefill_rank: Rank
    reason: Text


class RoomStatus(msgspec.Struct, frozen=True):
    """Where one room stands on a node, with the wall-clock time it entered each state."""

    room: RoomId
    state: Annotated[int, msgspec.Meta(ge=0, le=4)]
    reason: Text | None = None
    timestamps: Annotated[dict[str, float], msgspec.Meta(max_length=8)] = {}
    output_ids: Annotated[list[Token], msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    timings: Annotated[dict[str, float], msgspec.Meta(max_length=16)] = {}


class RoomReports(msgspec.Struct, frozen=True):
    """Node -> bootstrap: the rooms whose state changed since the last report."""

    node_id: Text
    reports: Annotated[list[RoomStatus], msgspec.Meta(min_length=1, max_length=MAX_REPORTS)]


Message = (
    PrefillRoom
    | DecodeRoom
    | AbortRoom
    | TransferRequest
    | TransferAccepted
    | TransferStarted
    | KvDone
    | RoomReleased
    | RoomReports
)

KIND_OF: dict[type, Kind] = {
    PrefillRoom: Kind.PREFILL_ROOM,
    DecodeRoom: Kind.DECODE_ROOM,
    AbortRoom: Kind.ABORT_ROOM,
    TransferRequest: Kind.TRANSFER_REQUEST,
    TransferAccepted: Kind.TRANSFER_ACCEPTED,
    TransferStarted: Kind.TRANSFER_STARTED,
    KvDone: Kind.DONE_AUX,
    RoomReleased: Kind.ROOM_RELEASED,
    RoomReports: Kind.ROOM_REPORTS,
}
_DECODERS: dict[Kind, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(cls) for cls, kind in KIND_OF.items()
}
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message, aux: bytes | None = None) -> list[bytes]:
    """Frames for ``msg``; ``aux`` is required for KvDone and refused otherwise."""
    kind = KIND_OF[type(msg)]
    if (kind is Kind.DONE_AUX) != (aux is not None):
        raise ValueError("aux travels with KvDone and only with it")
    frames = [_HEADER.pack(MAGIC, PROTOCOL_VERSION, kind), _encoder.encode(msg)]
    if aux is not None:
        frames.append(aux)
    return frames


def decode(frames: list[Any]) -> tuple[Message, memoryview | None]:
    """Decode a received multipart message into (message, aux frame or None).

    The aux frame is None for every kind but DONE_AUX, and for a DONE_AUX
    whose aux frame was lost.

    Raises a ProtocolError subclass for anything that is not a well-formed
    message of this protocol version. Range checks against local state are the
    receiver's job.
    """
    if len(frames) < 2:
        raise MalformedFrame(f"expected at least 2 frames, got {len(frames)}")
    header = memoryview(frames[0])
    if header.nbytes != HEADER_BYTES:
        raise MalformedFrame(f"header of {header.nbytes} bytes, expected {HEADER_BYTES}")
    magic, version, raw_kind = _HEADER.unpack(header)
    if magic != MAGIC:
        raise MalformedFrame("bad magic")
    if version != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    try:
        kind = Kind(raw_kind)
    except ValueError as exc:
        raise UnknownMessageType(f"unknown message kind {raw_kind}") from exc
    allowed_frames = (2, 3) if kind is Kind.DONE_AUX else (2,)
    if len(frames) not in allowed_frames:
        raise MalformedFrame(f"{kind.name} cannot have {len(frames)} frames")
    body = memoryview(frames[1])
    if body.nbytes > MAX_BODY_BYTES:
        raise FrameTooLarge(f"{kind.name} body of {body.nbytes} bytes")
    try:
        msg = _DECODERS[kind].decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedFrame(f"{kind.name}: {exc}") from exc
    aux = memoryview(frames[2]) if len(frames) == 3 else None
    if aux is not None and aux.nbytes > MAX_BODY_BYTES:
        raise FrameTooLarge(f"aux frame of {aux.nbytes} bytes")
    return msg, aux


def is_done_aux(frames: list[Any]) -> bool:
    """Whether the header says done+aux; a cheap look that checks nothing else."""
    header = frames[0]
    return len(header) == HEADER_BYTES and header[-1] == Kind.DONE_AUX


def peek_room(frames: list[Any]) -> int | None:
    """Best-effort room id of a frame that failed to decode, for the log line."""
    try:
        obj = msgspec.msgpack.decode(memoryview(frames[1]))
        room = obj.get("room") if isinstance(obj, dict) else None
        return room if isinstance(room, int) else None
    except Exception:
        return None
