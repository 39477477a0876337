"""Registered nodes, their liveness, load and standing."""

import logging
import time

from shared.head_split import mapping_problem
from shared.registration import Heartbeat, NodeRegistration

log = logging.getLogger(__name__)


class Node:
    def __init__(self, reg: NodeRegistration):
        self.reg = reg
        self.last_seen = time.monotonic()
        self.alive = True
        self.healthy = True  # the node says it can serve (all its ranks live)
        self.problem: str | None = None
        self.draining = False
        self.rooms: set[int] = set()  # rooms in flight placed here
        self.free_pages = reg.num_pages
        self.heartbeat = Heartbeat()
        # Room assignments go to the node's leader, rank 0, which hands them to its ranks.
        self.leader = reg.ranks[0].peer()
        # Built once: every room placed here names them to its peer node.
        self.peers = [r.peer() for r in reg.ranks]

    @property
    def id(self) -> str:
        return self.reg.node_id

    @property
    def role(self) -> str:
        return self.reg.role

    @property
    def key(self) -> str:
        """The CURVE key the node reports with (its rank 0's)."""
        return self.reg.ranks[0].public_key

    @property
    def placeable(self) -> bool:
        return self.alive and self.healthy and not self.draining

    def view(self) -> dict[str, object]:
        ranks = {s.rank: s for s in self.heartbeat.ranks}
        return {
            "node_id": self.id,
            "role": self.role,
            "http_url": self.reg.http_url,
            "version": self.reg.version,
            "alive": self.alive,
            "healthy": self.healthy,
            "draining": self.draining,
            "problem": self.problem,
            "tp_size": self.reg.tp_size,
            "ranks": [
                {
                    **r.model_dump(),
                    "alive": self.alive and (ranks[r.rank].alive if r.rank in ranks else True),
                    "free_pages": ranks[r.rank].free_pages if r.rank in ranks else None,
                }
                for r in self.reg.ranks
            ],
            "model": self.reg.model.model_dump(),
            "compat_hash": self.reg.model.compat_hash,
            "verify_kv": self.reg.verify_kv,
            "num_pages": self.reg.num_pages,
            "free_pages": self.free_pages,
            "rooms_in_flight": len(self.rooms),
            "seconds_since_heartbeat": round(time.monotonic() - self.last_seen, 3),
        }


class Incompatible(Exception):
    """A registration that cannot pair with the cluster's other nodes, and why."""


class NodeRegistry:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.nodes: dict[str, Node] = {}

    def check(self, reg: NodeRegistration) -> None:
        """Raise Incompatible unless ``reg`` can exchange KV with every live node of the other role."""
        if [r.rank for r in reg.ranks] != list(range(reg.tp_size)):
            raise Incompatible("ranks must be numbered 0..n-1, in order")
        problem = mapping_problem([r.heads for r in reg.ranks], reg.model.num_kv_heads)
        if problem:
            raise Incompatible(f"KV heads of the ranks cannot map: {problem}")
        for other in self.nodes.values():
            if other.alive and other.id != reg.node_id and other.role != reg.role:
                reason = reg.model.mismatch(other.reg.model)
                if reason:
                    raise Incompatible(f"model does not match {other.role} node {other.id}: {reason}")

    def register(self, reg: NodeRegistration) -> tuple[Node, Node | None]:
        """Add or replace a node; returns (new node, the incarnation it replaced)."""
        self.check(reg)
        previous = self.nodes.get(reg.node_id)
        node = Node(reg)
        self.nodes[reg.node_id] = node
        log.info("node %s registered as %s with %d rank(s)", node.id, reg.role, reg.tp_size)
        return node, previous

    def heartbeat(self, node_id: str, beat: Heartbeat) -> Node | None:
        node = self.nodes.get(node_id)
        if node is None:
            return None
        node.last_seen = time.monotonic()
        node.heartbeat = beat
        node.free_pages = beat.free_pages
        if node.healthy != beat.healthy:
            log.warning(
                "node %s is %s: %s", node_id, "healthy" if beat.healthy else "unhealthy", beat.problem
            )
        node.healthy, node.problem = beat.healthy, beat.problem
        if not node.alive:
            log.info("node %s is alive again", node_id)
            node.alive = True
        return node

    def pick(self, role: str) -> Node | None:
        """The placeable node of ``role`` with the fewest rooms in flight."""
        live = [n for n in self.nodes.values() if n.placeable and n.role == role]
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
        return sum(1 for n in self.nodes.values() if n.placeable and n.role == role)

    def by_key(self, key: str) -> list[Node]:
        return [n for n in self.nodes.values() if n.key == key]
