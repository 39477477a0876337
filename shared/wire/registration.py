"""How a node joins the cluster: one schema, used by the nodes that send it and the bootstrap
that checks it."""

import hashlib
import json
from typing import Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator, WithJsonSchema

from shared.kv.layout import DTYPE_NAMES, KVLayout
from shared.wire import protocol

Role = Literal["prefill", "decode"]
# Why a node leaves, as it tells the bootstrap: it was stopped, or it lost a rank process and
# exits for its supervisor to start it again. A leave without one is an operator's.
LeaveCause = Literal["shutdown", "rank_death"]
# A heartbeat's answer names at most this many transfers whose writers are gone (the rest: the lease).
MAX_WRITERS_GONE = 4096
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
    # What computes and holds the KV: kvroom's own nodes, or a vLLM server with kvroom's connector
    # ("vllm 0.32.0"). The two lay KV out differently, so they never exchange it.
    engine: str = Field(default="kvroom", pattern=r"^(kvroom|vllm [0-9A-Za-z.+-]{1,32})$")

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


def _peer_rank(value: Any) -> protocol.PeerRank:
    """A rank of the registration, checked by the wire's own rules (``public_key`` may be left out
    where security is off)."""
    if isinstance(value, protocol.PeerRank):
        return value
    if not isinstance(value, dict):
        raise ValueError("a rank is an object")
    try:
        return msgspec.convert({"public_key": "", **value}, protocol.PeerRank)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


_PEER_SCHEMA = msgspec.json.schema_components([protocol.PeerRank])[1]["PeerRank"]
_PEER_SCHEMA["required"] = [f for f in _PEER_SCHEMA["required"] if f != "public_key"]
_PEER_SCHEMA["additionalProperties"] = False

# The wire's struct for a rank, inside the registration's pydantic schema: one definition of a rank.
RankInfo = Annotated[
    protocol.PeerRank,
    PlainValidator(_peer_rank),
    PlainSerializer(msgspec.to_builtins, return_type=dict),
    WithJsonSchema(_PEER_SCHEMA),
]


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
    report_key: str = Field(
        default="",
        pattern=r"^$|" + Z85_KEY,
        description="the CURVE key the node's reports come from, where it is not rank 0's "
        "(a vLLM server reports from its scheduler process)",
    )

    @property
    def tp_size(self) -> int:
        return len(self.ranks)

    @property
    def is_vllm(self) -> bool:
        """A vLLM server: its rooms come as requests to its OpenAI endpoint (``http_url``)."""
        return self.model.engine != "kvroom"


class RankStatus(Strict):
    rank: int = Field(ge=0, lt=protocol.MAX_RANKS)
    alive: bool
    free_pages: int = Field(ge=0)
    free_aux_slots: int = Field(default=0, ge=0)


class Heartbeat(Strict):
    rooms_in_flight: int = Field(default=0, ge=0)
    # The node's oldest live transfers: the bootstrap names those it no longer knows, which the node ends.
    transfers: list[protocol.TransferId] = Field(default=[], max_length=4096)
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
    unknown_transfers: list[protocol.TransferId] = Field(
        default=[], description="transfers of the heartbeat the cluster does not hold"
    )
    writers_gone: list[protocol.TransferId] = Field(
        default=[],
        max_length=MAX_WRITERS_GONE,
        description="a vLLM decode server's transfers whose prefill process ended (it left, or was "
        "restarted): nothing more is written for them once what was sent has landed",
    )
    params_key: str = Field(
        default="",
        pattern=r"^$|^[0-9a-f]{64}$",
        description="the cluster's key for transfer parameters (hex): a vLLM server acts only on "
        "those it signed (shared.wire.grants)",
    )


class ParamsKey(Strict):
    """``GET /params-key``: the cluster's key for transfer parameters, for a vLLM API server."""

    params_key: str = Field(pattern=r"^[0-9a-f]{64}$")
