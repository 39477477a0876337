"""Every ZMQ message kvroom sends, as typed structs, and the frame codec.

A message is a ZMQ multipart message: a 7-byte header frame
(magic ``KVRM``, protocol version u16, message kind u8), a msgpack body frame,
and for ``DONE_AUX`` a third frame holding the raw aux record. The header is
checked before the body is decoded, so a peer speaking another version is
rejected without parsing anything it sent.

A ``DONE_AUX`` that arrives with its aux frame cut off still decodes (the aux
comes back as None): the receiver learns the KV is done and keeps waiting for
the aux, which is the one state the aux timeout exists for.

Who sent a message is not in the message: between services every socket is
CURVE-authenticated, and the receiver checks the sender's public key against
the peer the message claims to come from (the bootstrap, or a room's peer rank).

Messages between the ranks of one node (``RANK_*``) travel over the node's own
``ipc://`` sockets, never over the network.

Changelog
    1  first version: PREFILL_ROOM, DECODE_ROOM, ABORT_ROOM, TRANSFER_REQUEST,
       TRANSFER_ACCEPTED, TRANSFER_STARTED, DONE_AUX, ROOM_RELEASED, ROOM_REPORTS.
    2  senders are known by their CURVE key: the cluster token is gone from room
       assignments and aborts, and the transfer request no longer names the
       decode's session and endpoint (the room's assignment does). Peer ranks
       carry their public key and the KV heads they hold; the transfer request
       the decode rank's heads; done+aux the digest of every page it wrote.
       Room assignments go to a node's leader, which hands them to its ranks.
       New: ROOM_TOKENS (decoded tokens as they come), RANK_STATES and
       RANK_AGREED (agreement between the ranks of a node), RANK_HEALTH, RANK_READY.
    3  ASSIGNMENTS: the rooms the bootstrap placed on a node and its aborts for
       it, gathered over one turn of the bootstrap's event loop, in one message;
       TRANSFER_REQUESTS: a decode rank's transfer requests to one prefill rank
       from one turn of its loop. A message of either is taken item by item, as
       if each came alone.
    4  DONE_AUX names the kind of its page digests (``digest_kind``: ``xxh3`` from
       a CPU pool, ``wsum`` from a CUDA pool); the decode computes the same kind.
    5  REVOKE_LEASE: a decode rank asks a prefill rank for the pages it lent it
       back (the room failed); before, a peer's ABORT_ROOM meant that too. ABORT_ROOM
       now comes from the bootstrap only.
    6  a node knows a room only by its placement attempt: every node-facing message,
       report and rank state names it ``transfer`` (it was ``room``, the same number
       but a different id from the client's room after a re-placement). KvDone is
       DoneAux, the name of its kind.
    7  TRANSFER_REQUEST may name ``layer_stride``: the decode's KV is a vLLM paged cache, one
       region per layer that far apart, a page (vLLM's block) in each; 0 for kvroom's own pages,
       which hold every layer. Registrations name the engine that holds the KV.
"""

import enum
import struct
from typing import Annotated, Any, NewType

import msgspec

from shared.errors import (
    FrameTooLarge,
    MalformedFrame,
    UnknownMessageType,
    VersionMismatch,
)
from shared.kv.digest_kind import DigestKind
from shared.kv.head_split import HeadRange
from shared.room.record import TransferId
from shared.room.states import RoomState, failed, public_state

PROTOCOL_VERSION = 7
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
MAX_ASSIGNMENTS = 1024
MAX_HEADS = 1024
MAX_STOP = 8
MAX_STOP_CHARS = 256

# Room and transfer ids are exact in a float64 (JSON tools, JavaScript): below 2**53, never 0.
MAX_ROOM_ID = (1 << 53) - 1
Transfer = Annotated[TransferId, msgspec.Meta(gt=0, le=MAX_ROOM_ID)]
# A client's room: it keeps its id across re-placements, while each placement gets a TransferId.
RoomId = NewType("RoomId", int)
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
NonNegative = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Digest = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Head = Annotated[int, msgspec.Meta(ge=0, le=MAX_HEADS)]
HeadCount = Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]
# Where a rank's transfer engine (host:port) and its ZMQ socket (tcp://host:port) are reached.
SessionId = Annotated[str, msgspec.Meta(min_length=3, max_length=256, pattern=r"^[^\s:]+:\d{1,5}$")]
ZmqEndpoint = Annotated[str, msgspec.Meta(min_length=7, max_length=256, pattern=r"^tcp://[^\s]+:\d{1,5}$")]
# A CURVE public key in Z85 (40 characters); empty where security is off.
PublicKey = Annotated[str, msgspec.Meta(max_length=40)]
Text = Annotated[str, msgspec.Meta(max_length=256)]
StopText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]


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
    ROOM_TOKENS = 10
    RANK_STATES = 11
    RANK_AGREED = 12
    RANK_HEALTH = 13
    RANK_READY = 14
    ASSIGNMENTS = 15
    TRANSFER_REQUESTS = 16
    REVOKE_LEASE = 17


class PeerRank(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank of a node as its peers reach it, and the KV heads it holds: in the node's
    registration, and in every assignment that names the room's peer ranks."""

    rank: Rank
    session_id: SessionId
    zmq_endpoint: ZmqEndpoint
    public_key: PublicKey  # empty where security is off
    kv_head_start: Head
    kv_head_count: HeadCount

    @property
    def heads(self) -> HeadRange:
        return HeadRange(self.kv_head_start, self.kv_head_count)


class PrefillRoom(msgspec.Struct, frozen=True):
    """Bootstrap -> a prefill node's leader: compute this prompt's KV for these decode ranks."""

    transfer: Transfer
    input_ids: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
    decode_node: Text
    decode_ranks: Annotated[list[PeerRank], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]


class DecodeRoom(msgspec.Struct, frozen=True):
    """Bootstrap -> a decode node's leader: take a room whose KV comes from these prefill ranks."""

    transfer: Transfer
    prompt_len: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]
    prefill_node: Text
    prefill_ranks: Annotated[list[PeerRank], msgspec.Meta(min_length=1, max_length=MAX_RANKS)]
    # Decoding ends early at one of these strings (cut from the output) or an end-of-text token.
    stop: Annotated[list[StopText], msgspec.Meta(max_length=MAX_STOP)] = []
    stream: bool = False  # send decoded tokens to the bootstrap as they come


class AbortRoom(msgspec.Struct, frozen=True):
    """Bootstrap -> a node's leader: end the room FAILED with ``reason``."""

    transfer: Transfer
    rank: Rank  # the rank addressed; 0 for a node's leader
    reason: Text
    peer_gone: bool = False  # the other node's process ended (it left, or another took its id)


class RevokeLease(msgspec.Struct, frozen=True):
    """Decode rank -> prefill rank: the room failed with ``reason``; write nothing more into the
    pages I lent you, and answer with RoomReleased once none of your writes can still move."""

    transfer: Transfer
    rank: Rank  # the prefill rank addressed
    reason: Text


class Assignments(msgspec.Struct, frozen=True):
    """Bootstrap -> a node's leader: the rooms placed on the node, then the aborts for it, from one
    turn of the bootstrap's event loop; taken in that order, each as if it came alone."""

    prefill_rooms: Annotated[list[PrefillRoom], msgspec.Meta(max_length=MAX_ASSIGNMENTS)] = []
    decode_rooms: Annotated[list[DecodeRoom], msgspec.Meta(max_length=MAX_ASSIGNMENTS)] = []
    aborts: Annotated[list[AbortRoom], msgspec.Meta(max_length=MAX_ASSIGNMENTS)] = []


class TransferRequest(msgspec.Struct, frozen=True):
    """Decode rank -> prefill rank: write the room's KV for my heads into these pages of mine."""

    transfer: Transfer
    rank: Rank  # the prefill rank addressed
    decode_rank: Rank
    kv_base_ptr: NonNegative
    num_pages: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    page_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]
    page_indices: Annotated[list[NonNegative], msgspec.Meta(max_length=MAX_PAGES_PER_ROOM)]
    aux_slot: NonNegative
    # Bytes from one layer's pages to the next's, where each layer has its own region (a vLLM
    # decode: ``page_bytes`` is then one layer's block); 0: a page holds every layer.
    layer_stride: NonNegative = 0


class TransferRequests(msgspec.Struct, frozen=True):
    """Decode rank -> prefill rank: the transfer requests of one turn of the decode's event loop."""

    requests: Annotated[list[TransferRequest], msgspec.Meta(min_length=1, max_length=MAX_ASSIGNMENTS)]


class TransferAccepted(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank: the request is valid; the KV follows when computed."""

    transfer: Transfer
    rank: Rank  # the decode rank addressed
    prefill_rank: Rank


class TransferStarted(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank: the KV writes for the room have begun."""

    transfer: Transfer
    rank: Rank  # the decode rank addressed
    prefill_rank: Rank


class DoneAux(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank, sent only after every KV write completed.

    Always travels with the aux record as the third frame of the same message.
    ``digests`` (verify mode) holds one digest per destination page, in the
    order of the request's page indices, over the bytes this rank wrote there,
    of the kind ``digest_kind`` names (``shared.kv.digest``).
    """

    transfer: Transfer
    rank: Rank  # the decode rank addressed
    prefill_rank: Rank
    aux_slot: NonNegative
    pages_written: NonNegative
    bytes_written: NonNegative
    completed_at: float  # wall clock when the last KV write completed, for aux latency
    digests: Annotated[list[Digest], msgspec.Meta(max_length=MAX_PAGES_PER_ROOM)] | None = None
    digest_kind: DigestKind = "xxh3"


class RoomReleased(msgspec.Struct, frozen=True):
    """Prefill rank -> decode rank: I will not touch this room's pages again.

    ``reason`` says why the prefill gave the room up; empty if it had finished.
    Sent only once no write of the room can still be moving.
    """

    transfer: Transfer
    rank: Rank
    prefill_rank: Rank
    reason: Text
    wrote: bool = False  # some of its writes began: they have landed, or never will


class RoomRecord(msgspec.Struct, kw_only=True):
    """Where a room stands and what it produced: the one record of a room, kept by a node's room
    (``Room``), sent in its reports (``RoomStatus``) and kept by the bootstrap (``RoomData``).

    ``state`` is the transfer's (a ``RoomState``), with the wall-clock time it entered each state;
    ``outcome`` is the request's end once the transfer succeeded: "completed", or "failed" with
    ``reason`` (the decode raised; its node was lost mid-decode).
    """

    state: Annotated[int, msgspec.Meta(ge=0, le=4)] = int(RoomState.BOOTSTRAPPING)
    reason: Text | None = None
    timestamps: Annotated[dict[str, float], msgspec.Meta(max_length=8)] = {}
    timings: Annotated[dict[str, float], msgspec.Meta(max_length=16)] = {}
    output_ids: Annotated[list[Token], msgspec.Meta(max_length=MAX_TOKENS)] | None = None
    outcome: Text | None = None
    finish_reason: Text | None = None  # "stop" or "length", once completed

    @property
    def failed(self) -> bool:
        return failed(self.state, self.outcome)

    @property
    def public_state(self) -> str:
        return public_state(self.state, self.outcome)


class RoomStatus(RoomRecord):
    """Node -> bootstrap, in RoomReports: the record of one placement on that node."""

    transfer: Transfer


class RoomReports(msgspec.Struct, frozen=True):
    """Node -> bootstrap: the rooms whose state changed since the last report."""

    node_id: Text
    reports: Annotated[list[RoomStatus], msgspec.Meta(min_length=1, max_length=MAX_REPORTS)]


class TokenChunk(msgspec.Struct, frozen=True):
    transfer: Transfer
    offset: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]  # index of the first token here
    tokens: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]


class RoomTokens(msgspec.Struct, frozen=True):
    """Decode node -> bootstrap: tokens decoded since the last message, for streaming rooms."""

    node_id: Text
    chunks: Annotated[list[TokenChunk], msgspec.Meta(min_length=1, max_length=MAX_REPORTS)]


class RankState(msgspec.Struct, frozen=True):
    """One room as one rank sees it on its own: what the node's ranks agree over.

    ``digest`` is the crc32 of the aux record the rank validated (decode, once
    ready); ranks whose records differ must not succeed.
    """

    transfer: Transfer
    state: Annotated[int, msgspec.Meta(ge=0, le=4)]
    reason: Text | None = None
    digest: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] = 0


class RankStates(msgspec.Struct, frozen=True):
    """Rank -> its node's leader: rooms whose state on that rank changed."""

    rank: Rank
    states: Annotated[list[RankState], msgspec.Meta(min_length=1, max_length=1 << 16)]


class RankAgreed(msgspec.Struct, frozen=True):
    """Leader -> every rank of the node: rooms whose agreed state changed, in the order to act on."""

    states: Annotated[list[RankState], msgspec.Meta(min_length=1, max_length=1 << 16)]


class RankHealth(msgspec.Struct, frozen=True):
    """Rank -> its node's leader, now and then: what the rank holds."""

    rank: Rank
    free_pages: NonNegative
    total_pages: NonNegative
    free_aux_slots: NonNegative
    total_aux_slots: NonNegative
    rooms_in_flight: NonNegative
    fenced_rooms: NonNegative
    fenced_pages: NonNegative = 0  # pages of failed rooms a writer may still write into
    # Pages whose lease to a writer closed so far: returned by it, revoked (it is gone), expired.
    lent_pages_returned: NonNegative = 0
    lent_pages_revoked: NonNegative = 0
    lent_pages_expired: NonNegative = 0
    writes_in_flight: NonNegative = 0  # a prefill's rooms whose writes to peers may still move


class RankReady(msgspec.Struct, frozen=True):
    """Rank -> its node's leader, once at start: how peers reach the rank."""

    peer: PeerRank


Message = (
    PrefillRoom
    | DecodeRoom
    | AbortRoom
    | RevokeLease
    | Assignments
    | TransferRequest
    | TransferRequests
    | TransferAccepted
    | TransferStarted
    | DoneAux
    | RoomReleased
    | RoomReports
    | RoomTokens
    | RankStates
    | RankAgreed
    | RankHealth
    | RankReady
)

KIND_OF: dict[type, Kind] = {
    PrefillRoom: Kind.PREFILL_ROOM,
    DecodeRoom: Kind.DECODE_ROOM,
    AbortRoom: Kind.ABORT_ROOM,
    RevokeLease: Kind.REVOKE_LEASE,
    Assignments: Kind.ASSIGNMENTS,
    TransferRequest: Kind.TRANSFER_REQUEST,
    TransferRequests: Kind.TRANSFER_REQUESTS,
    TransferAccepted: Kind.TRANSFER_ACCEPTED,
    TransferStarted: Kind.TRANSFER_STARTED,
    DoneAux: Kind.DONE_AUX,
    RoomReleased: Kind.ROOM_RELEASED,
    RoomReports: Kind.ROOM_REPORTS,
    RoomTokens: Kind.ROOM_TOKENS,
    RankStates: Kind.RANK_STATES,
    RankAgreed: Kind.RANK_AGREED,
    RankHealth: Kind.RANK_HEALTH,
    RankReady: Kind.RANK_READY,
}
_DECODERS: dict[Kind, msgspec.msgpack.Decoder[Any]] = {
    kind: msgspec.msgpack.Decoder(cls) for cls, kind in KIND_OF.items()
}
_encoder = msgspec.msgpack.Encoder()


def encode(msg: Message, aux: bytes | None = None) -> list[bytes]:
    """Frames for ``msg``; ``aux`` is required for DoneAux and refused otherwise."""
    kind = KIND_OF[type(msg)]
    if (kind is Kind.DONE_AUX) != (aux is not None):
        raise ValueError("aux travels with DoneAux and only with it")
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
    header = memoryview(frames[0])
    return header.nbytes == HEADER_BYTES and header[-1] == Kind.DONE_AUX


def peek_transfer(frames: list[Any]) -> int | None:
    """Best-effort transfer id of a frame that failed to decode, for the log line."""
    try:
        obj = msgspec.msgpack.decode(memoryview(frames[1]))
        transfer = obj.get("transfer") if isinstance(obj, dict) else None
        return transfer if isinstance(transfer, int) else None
    except Exception:
        return None
