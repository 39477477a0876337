"""Registered nodes as the bootstrap reads them from the store: who they are, whether rooms may go there."""

import logging
import time

import msgspec

from bootstrap.store import Load, NodeData, Store
from shared.kv.head_split import mapping_problem
from shared.metrics import ServiceMetrics
from shared.wire.registration import Heartbeat, NodeRegistration

log = logging.getLogger(__name__)
_heartbeat = msgspec.json.Decoder()
# A node whose heartbeat is this many intervals late gets no new room, before its TTL runs out.
LATE_HEARTBEATS = 2.5


class Node:
    """A node's registration (parsed once) and its latest standing."""

    def __init__(self, data: NodeData, reg: NodeRegistration):
        self.data = data
        self.reg = reg
        self.alive = True
        self.load = Load()
        # Room assignments go to the node's leader, rank 0, which hands them to its ranks.
        self.leader = reg.ranks[0]
        # Built once: every room placed here names them to its peer node.
        self.peers = list(reg.ranks)

    @property
    def id(self) -> str:
        return self.reg.node_id

    @property
    def role(self) -> str:
        return self.reg.role

    @property
    def key(self) -> str:
        """The CURVE key of the node's leader, rank 0, whose socket the bootstrap watches."""
        return self.reg.ranks[0].public_key

    @property
    def report_key(self) -> str:
        """The CURVE key the node reports with: rank 0's, unless it named another (a vLLM server
        reports from its scheduler process)."""
        return self.reg.report_key or self.key

    @property
    def heartbeat(self) -> Heartbeat:
        return (
            Heartbeat.model_validate_json(self.data.heartbeat)
            if self.data.heartbeat != b"{}"
            else Heartbeat()
        )

    @property
    def late(self) -> bool:
        return time.time() - self.data.last_seen > LATE_HEARTBEATS * self.reg.heartbeat_interval_s

    @property
    def in_service(self) -> bool:
        """Alive, healthy and not draining: placeable now, or once a late heartbeat comes."""
        d = self.data
        return self.alive and not d.dead and d.healthy and not d.draining

    @property
    def placeable(self) -> bool:
        return self.in_service and not self.late

    @property
    def free_pages(self) -> int:
        """Pages not taken by rooms placed here, by every bootstrap's account. (Pages a failed room
        still fences are not counted: a room they crowd out fails no_capacity and is placed again.)"""
        return self.reg.num_pages - self.load.pages

    def view(self) -> dict[str, object]:
        beat = self.heartbeat
        ranks = {s.rank: s for s in beat.ranks}
        return {
            "node_id": self.id,
            "role": self.role,
            "http_url": self.reg.http_url,
            "version": self.reg.version,
            "alive": self.alive and not self.data.dead,
            "healthy": self.data.healthy,
            "draining": self.data.draining,
            "placeable": self.placeable,
            "problem": self.data.problem,
            "tp_size": self.reg.tp_size,
            "ranks": [
                {
                    **msgspec.structs.asdict(r),
                    "alive": self.alive and (ranks[r.rank].alive if r.rank in ranks else True),
                    "free_pages": ranks[r.rank].free_pages if r.rank in ranks else None,
                }
                for r in self.reg.ranks
            ],
            "model": self.reg.model.model_dump(),
            "compat_hash": self.reg.model.compat_hash,
            "verify_kv": self.reg.verify_kv,
            "num_pages": self.reg.num_pages,
            "free_pages": beat.free_pages,
            "placed_pages": self.load.pages,
            "rooms_in_flight": self.load.rooms,
            "seconds_since_heartbeat": round(time.time() - self.data.last_seen, 3),
        }


class Incompatible(Exception):
    """A registration that cannot pair with the cluster's other nodes, and why."""


def check(reg: NodeRegistration, others: list[Node]) -> None:
    """Raise Incompatible unless ``reg`` can exchange KV with every live node of the other role."""
    if [r.rank for r in reg.ranks] != list(range(reg.tp_size)):
        raise Incompatible("ranks must be numbered 0..n-1, in order")
    problem = mapping_problem([r.heads for r in reg.ranks], reg.model.num_kv_heads)
    if problem:
        raise Incompatible(f"KV heads of the ranks cannot map: {problem}")
    for other in others:
        if other.alive and not other.data.dead and other.id != reg.node_id and other.role != reg.role:
            reason = reg.model.mismatch(other.reg.model)
            if reason:
                raise Incompatible(f"model does not match {other.role} node {other.id}: {reason}")


class Registry:
    """The nodes as the store has them, each registration parsed once, and the last look at them all:
    what reports, room views and lost connections are checked against between two looks."""

    def __init__(self, store: Store, metrics: ServiceMetrics):
        self._store = store
        self._parsed: dict[str, tuple[float, NodeRegistration]] = {}
        self.last_look: list[Node] = []
        self._live_counts = {"prefill": 0, "decode": 0}
        for role in self._live_counts:
            metrics.gauge_function(
                f"kvroom_live_{role}_nodes",
                f"Placeable {role} nodes",
                lambda role=role: self._live_counts[role],  # type: ignore[misc]
            )

    def read(self, data: NodeData) -> Node:
        """The node of a stored record, its registration parsed again only when it changed."""
        cached = self._parsed.get(data.node_id)
        if cached is None or cached[0] != data.registered_at:
            cached = (data.registered_at, NodeRegistration.model_validate_json(data.registration))
            self._parsed[data.node_id] = cached
        return Node(data, cached[1])

    async def nodes(self) -> list[Node]:
        """Every registered node with its liveness and load, as the store has them now."""
        out = []
        for data in await self._store.nodes():
            node = self.read(data)
            node.alive = await self._store.alive(node.id)
            node.load = await self._store.load(node.id)
            out.append(node)
        self.last_look = out
        for role in self._live_counts:
            self._live_counts[role] = sum(1 for n in out if n.role == role and n.placeable)
        return out

    async def node(self, node_id: str) -> Node | None:
        data = await self._store.node(node_id)
        return self.read(data) if data is not None else None

    def known(self, node_id: str) -> Node | None:
        """The node as the last look saw it."""
        return next((n for n in self.last_look if n.id == node_id), None)

    def sessions(self, node_id: str) -> list[str]:
        """The session ids of a node's ranks, from the last look."""
        node = self.known(node_id)
        return [r.session_id for r in node.reg.ranks] if node is not None else []

    def live_count(self, role: str) -> int:
        return self._live_counts[role]
