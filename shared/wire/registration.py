"""How a node joins the cluster: one schema, used by the nodes that send it and the bootstrap
that checks it."""

import hashlib
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.kv.head_split import HeadRange
from shared.kv.layout import DTYPE_NAMES, KVLayout
from shared.wire import protocol

Role = Literal["prefill", "decode"]
Z85_KEY = r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelIdentity(Strict):
    """Everything two nodes must share to exchange KV. Compared once, at registration."""

    name: str = Field(min_length=1, max_length=256, description="what /v1/models lists")
    architecture: str = Field(min_length=1, max_length=128)
    weights: str = Field(min_length=1, max_length=128, description="a digest of the weights")
    tokenizer: str = Field(min_length=1, max_length=128, description="a digest of the tokenizer")
    dtype: str = Field(pattern="^(" + "|".join(DTYPE_NAMES) + ")$")
    num_layers: int = Field(ge=1, le=1024)
    num_heads: int = Field(ge=1, le=protocol.MAX_HEADS)
    num_kv_heads: int = Field(ge=1, le=protocol.MAX_HEADS)
    head_dim: int = Field(ge=1, le=4096)
    vocab_size: int = Field(ge=1, le=1 << 24)
    page_size: int = Field(ge=1, le=1024)
    protocol_version: int = protocol.PROTOCOL_VERSION

    @property
    def compat_hash(self) -> str:
        """One hash over everything above: equal hashes, compatible nodes."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]

    def mismatch(self, other: "ModelIdentity") -> str | None:
        """The first field the two differ in, said plainly; None if they match."""
        if self.compat_hash == other.compat_hash:
            return None
        for field in type(self).model_fields:
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field} differs: {mine} != {theirs}"
        return None

    def layout(self, kv_heads_held: int) -> KVLayout:
        return KVLayout(self.num_layers, kv_heads_held, self.head_dim, self.page_size, self.dtype)


class RankInfo(Strict):
    rank: int = Field(ge=0, lt=protocol.MAX_RANKS)
    session_id: str = Field(min_length=3, max_length=256, pattern=r"^[^\s:]+:\d{1,5}$")
    zmq_endpoint: str = Field(min_length=7, max_length=256, pattern=r"^tcp://[^\s]+:\d{1,5}$")
    public_key: str = Field(default="", description="CURVE public key (Z85); empty with security off")
    kv_head_start: int = Field(ge=0, le=protocol.MAX_HEADS)
    kv_head_count: int = Field(ge=1, le=protocol.MAX_HEADS)

    @property
    def heads(self) -> HeadRange:
        return HeadRange(self.kv_head_start, self.kv_head_count)

    def peer(self) -> protocol.PeerRank:
        return protocol.PeerRank(
            self.rank,
            self.session_id,
            self.zmq_endpoint,
            self.public_key,
            self.kv_head_start,
            self.kv_head_count,
        )


class NodeRegistration(Strict):
    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    role: Role
    http_url: str = Field(min_length=8, max_length=256, pattern=r"^https?://")
    version: str = Field(max_length=64, description="the kvroom version the node runs")
    ranks: list[RankInfo] = Field(min_length=1, max_length=protocol.MAX_RANKS)
    model: ModelIdentity
    num_pages: int = Field(ge=1, le=1 << 30, description="KV pages per rank")
    verify_kv: bool = False
    heartbeat_interval_s: float = Field(default=1.0, gt=0, le=3600)

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


class RankStatus(Strict):
    rank: int = Field(ge=0, lt=protocol.MAX_RANKS)
    alive: bool
    free_pages: int = Field(ge=0)
    free_aux_slots: int = Field(default=0, ge=0)


class Heartbeat(Strict):
    rooms_in_flight: int = Field(default=0, ge=0)
    # The node's oldest live rooms: the bootstrap names those it no longer knows, which the node ends.
    rooms: list[int] = Field(default=[], max_length=4096)
    free_pages: int = Field(default=0, ge=0, description="the fewest free pages of any rank")
    healthy: bool = True
    problem: str | None = Field(default=None, max_length=512, description="why the node cannot serve")
    ranks: list[RankStatus] = Field(default=[], max_length=protocol.MAX_RANKS)


class Bootstrap(Strict):
    """A live bootstrap: where to report to it, and the key its messages come from."""

    id: str
    report_endpoint: str
    public_key: str


class Registered(Strict):
    """The bootstrap's answer to a registration or a heartbeat."""

    node_id: str
    bootstraps: list[Bootstrap] = Field(
        min_length=1, description="every live bootstrap, the answering one first"
    )
    node_ttl_s: float
    epoch: str = Field(
        description="changes when reports may have been lost: every node reports its rooms again"
    )
    unknown_rooms: list[int] = Field(
        default=[], description="rooms of the heartbeat the cluster does not hold"
    )
