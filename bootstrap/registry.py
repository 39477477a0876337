"""Registered nodes, their liveness and load."""

import logging
import time

from pydantic import BaseModel, Field

from shared import protocol
from shared.kv_layout import KVLayout

log = logging.getLogger(__name__)


class RankInfo(BaseModel):
    rank: int = Field(ge=0, lt=protocol.MAX_RANKS)
    session_id: str = Field(min_length=3, max_length=256, pattern=r"^[^\s:]+:\d{1,5}$")
    zmq_endpoint: str = Field(min_length=7, max_length=256, pattern=r"^tcp://[^\s]+:\d{1,5}$")


class LayoutInfo(BaseModel):
    num_layers: int = Field(ge=1, le=1024)
    num_kv_heads: int = Field(ge=1, le=1024)
    head_dim: int = Field(ge=1, le=4096)
    page_size: int = Field(ge=1, le=1024)
    dtype: str = Field(pattern=r"^(float32|float16|bfloat16)$")

    def layout(self) -> KVLayout:
        return KVLayout(**self.model_dump())


class NodeRegistration(BaseModel):
    node_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")
    role: str = Field(pattern=r"^(prefill|decode)$")
    http_url: str = Field(min_length=8, max_length=256, pattern=r"^https?://")
    ranks: list[RankInfo] = Field(min_length=1, max_length=protocol.MAX_RANKS)
    kv_layout: LayoutInfo
    num_pages: int = Field(ge=1, le=1 << 30)


class Heartbeat(BaseModel):
    rooms_in_flight: int = Field(0, ge=0)
    free_pages: int = Field(0, ge=0)


class Node:
    def __init__(self, reg: NodeRegistration):
        self.reg = reg
        self.layout = reg.kv_layout.layout()
        self.last_seen = time.monotonic()
        self.alive = True
        self.rooms: set[int] = set()  # rooms in flight placed here
        self.free_pages = reg.num_pages
        # Built once: every room placed here is sent to them.
        self.peers = [protocol.PeerRank(r.rank, r.session_id, r.zmq_endpoint) for r in reg.ranks]

    @property
    def id(self) -> str:
        return self.reg.node_id

    def view(self) -> dict[str, object]:
        return {
            "node_id": self.id,
            "role": self.reg.role,
            "http_url": self.reg.http_url,
            "alive": self.alive,
            "ranks": [r.model_dump() for r in self.reg.ranks],
            "kv_layout": self.reg.kv_layout.model_dump(),
            "num_pages": self.reg.num_pages,
            "free_pages": self.free_pages,
            "rooms_in_flight": len(self.rooms),
            "seconds_since_heartbeat": round(time.monotonic() - self.last_seen, 3),
        }


class LayoutConflict(Exception):
    pass


class NodeRegistry:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.nodes: dict[str, Node] = {}

    def register(self, reg: NodeRegistration) -> tuple[Node, Node | None]:
        """Add or replace a node; returns (new node, the incarnation it replaced)."""
        layout = reg.kv_layout.layout()
        for other in self.nodes.values():
            if other.alive and other.id != reg.node_id and other.reg.role != reg.role:
                reason = layout.mismatch(other.layout)
                if reason:
                    raise LayoutConflict(
                        f"KV layout does not match {other.reg.role} node {other.id}: {reason}"
                    )
        previous = self.nodes.get(reg.node_id)
        node = Node(reg)
        self.nodes[reg.node_id] = node
        log.info("node %s registered as %s with %d rank(s)", node.id, reg.role, len(reg.ranks))
        return node, previous

    def heartbeat(self, node_id: str, beat: Heartbeat) -> Node | None:
        node = self.nodes.get(node_id)
        if node is None:
            return None
        node.last_seen = time.monotonic()
        node.free_pages = beat.free_pages
        if not node.alive:
            log.info("node %s is alive again", node_id)
            node.alive = True
        return node

    def pick(self, role: str) -> Node | None:
        """The live node of ``role`` with the fewest rooms in flight."""
        live = [n for n in self.nodes.values() if n.alive and n.reg.role == role]
        return min(live, key=lambda n: len(n.rooms), default=None)

    def expire(self) -> list[Node]:
        """Mark nodes past their TTL dead; return the ones that just died."""
        now = time.monotonic()
        died = []
        for node in self.nodes.values():
            if node.alive and now - node.last_seen > self.ttl_s:
                node.alive = False
                died.append(node)
                log.warning("node %s missed heartbeats for %.1fs: marked dead", node.id, self.ttl_s)
        return died

    def live_count(self, role: str) -> int:
        return sum(1 for n in self.nodes.values() if n.alive and n.reg.role == role)
