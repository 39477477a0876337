"""Nodes joining, beating, draining and leaving: the cluster's membership as the store keeps it.

A node missing heartbeats past its TTL (as this bootstrap could watch: ``Observation``), or whose
connection dropped, is marked dead; a node that says it is broken, registers again (a restart) or
leaves is lost as well: the rooms it held fail (``RoomLifecycle.fail_rooms_of``), and are placed
again where they may be. How the loss was learned decides whether its peers may free the pages
it could still write (``lifecycle.WRITES_ENDED``).
"""

import logging
import time

from prometheus_client import Counter

from bootstrap.lifecycle import RoomLifecycle
from bootstrap.registry import Incompatible, Node, Registry, check
from bootstrap.settings import BootstrapSettings
from bootstrap.store import BootstrapInfo, NodeData, Store, StoreUnavailable
from bootstrap.tasks import Tasks
from shared.metrics import ServiceMetrics
from shared.wire.registration import Bootstrap, Heartbeat, NodeRegistration, Registered
from shared.wire.security import Security
from shared.wire.zmq_io import PushSockets

log = logging.getLogger(__name__)
# Two looks at the nodes further apart than this (or a quarter of the TTL, if more) mean this
# bootstrap was not watching in between. A shorter gap cannot run out the lease of a node that
# beats at least every half TTL, so it needs no grace.
BLIND_GAP_S = 1.0


# Seconds that go on while the host sleeps (a suspended VM's pause is a gap too), where there are.
_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def sessions(reg: NodeRegistration) -> list[tuple[str, str]]:
    """What differs between two processes of one node: their ranks' engine sessions and keys."""
    return [(r.session_id, r.public_key) for r in reg.ranks]


def clock() -> float:
    return time.clock_gettime(_CLOCK)


class Observation:
    """Whether a node is silent, judged from what this bootstrap itself could watch.

    Observer blindness is not node death. A node is dead by silence only if its lease ran out (no
    beat for ``ttl_s``) and this bootstrap has been watching for ``ttl_s`` as well: counted from its
    start, from its first look after a gap in its looks (it was stopped or stalled, or its store
    did not answer), and from the last time its store failed it. Each bootstrap sharing a store
    judges from its own observation. Pure: every instant is given, in ``clock()`` seconds.
    """

    def __init__(self, ttl_s: float, now: float):
        self.ttl_s = ttl_s
        self.gap_s = max(BLIND_GAP_S, ttl_s / 4)
        self.since = now  # observing since
        self._last_look = now

    def looked(self, now: float) -> float | None:
        """The nodes were read at ``now``; the gap since the last look if it was one of blindness."""
        gap = now - self._last_look
        self._last_look = now
        if gap > self.gap_s:
            self.since = now
            return gap
        return None

    def blind(self, now: float) -> None:
        """The store failed at ``now``: beats may have gone unrecorded."""
        self.since = now

    def silent(self, lease_ran_out: bool, now: float) -> bool:
        return lease_ran_out and now - self.since >= self.ttl_s


class NodeDirectory:
    def __init__(
        self,
        settings: BootstrapSettings,
        me: BootstrapInfo,
        security: Security,
        tokenizer_digest: str,
        store: Store,
        registry: Registry,
        lifecycle: RoomLifecycle,
        push: PushSockets,
        tasks: Tasks,
        metrics: ServiceMetrics,
    ):
        self._settings = settings
        self._me = me
        self._security = security
        self._tokenizer_digest = tokenizer_digest
        self._store = store
        self._registry = registry
        self._lifecycle = lifecycle
        self._push = push
        self._tasks = tasks
        self._observation = Observation(settings.node_ttl_s, clock())
        self._marked_dead = Counter(
            "kvroom_nodes_marked_dead_total",
            "Nodes marked dead, by why: missed_heartbeats or lost_connection",
            ["reason"],
            registry=metrics.registry,
        )
        self._left = Counter(
            "kvroom_nodes_left_total",
            "Nodes that left the cluster, by cause: shutdown (the node was stopped), rank_death (it "
            "lost a rank process and exits for its supervisor), operator (DELETE /nodes/{id} without one)",
            ["cause"],
            registry=metrics.registry,
        )

    def start(self) -> None:
        """Nodes are taken for dead only a TTL after this: a store that outlived us may hold leases
        that ran out while no bootstrap answered."""
        self._observation = Observation(self._settings.node_ttl_s, clock())

    def blind(self) -> None:
        """The store failed: no node is taken for dead before it had a TTL to beat again."""
        self._observation.blind(clock())

    async def registered(self, node: Node, beat: Heartbeat | None = None) -> Registered:
        """What a node learns from a registration or heartbeat: every live bootstrap, this one first."""
        others = [b for b in await self._store.bootstraps() if b.id != self._me.id]
        bootstraps = [
            Bootstrap(id=b.id, report_endpoint=b.report_endpoint, public_key=b.public_key)
            for b in [self._me, *others]
        ]
        unknown = []
        if beat is not None and beat.transfers:
            for transfer in beat.transfers:
                room_id = await self._store.room_of(transfer)
                room = await self._store.room(room_id) if room_id is not None else None
                if room is None or room.done or room.attempt.transfer != transfer:
                    unknown.append(transfer)
        return Registered(
            node_id=node.id,
            bootstraps=bootstraps,
            node_ttl_s=self._settings.node_ttl_s,
            epoch=await self._store.epoch(),
            unknown_transfers=unknown,
            params_key=(await self._store.params_key()).hex(),
            # Taken last: an answer that fails before it takes nothing away.
            writers_gone=self._lifecycle.writers_gone(node.id) if beat is not None else [],
        )

    async def register(self, reg: NodeRegistration) -> Node:
        if self._security.keys is not None and not all(r.public_key for r in reg.ranks):
            raise Incompatible("ZMQ security is on here: every rank must give its CURVE public key")
        if reg.model.tokenizer != self._tokenizer_digest:
            raise Incompatible(
                f"tokenizer differs from the bootstrap's ({self._settings.model}): "
                f"{reg.model.tokenizer} != {self._tokenizer_digest}"
            )
        check(reg, await self._registry.nodes())
        previous = await self._registry.node(reg.node_id)
        # The old process's rooms, read before the new one can be given any.
        held = await self._store.rooms_on(reg.node_id) if previous is not None else set()
        now = time.time()
        data = NodeData(reg.node_id, reg.model_dump_json().encode(), now, now)
        await self._store.put_node(data, self._settings.node_ttl_s)
        if previous is not None:
            # A node registered again lost whatever it held; its old endpoints may be gone. New
            # engine sessions or keys: another process, so the old one writes no more.
            restarted = sessions(previous.reg) != sessions(reg)
            await self._lifecycle.fail_rooms_of(
                previous.id, "restarted" if restarted else "registered_again", held
            )
            for rank in previous.reg.ranks:
                self._push.forget(rank.zmq_endpoint)
        log.info("node %s registered as %s with %d rank(s)", reg.node_id, reg.role, reg.tp_size)
        node = self._registry.read(data)
        self._push.watch(node.leader.zmq_endpoint, node.key, self._disconnected)
        return node

    async def heartbeat(self, node_id: str, beat: Heartbeat) -> Node | None:
        def change(node: NodeData) -> None:
            if node.healthy != beat.healthy:
                log.warning(
                    "node %s is %s: %s", node_id, "healthy" if beat.healthy else "unhealthy", beat.problem
                )
            if node.dead:
                log.info("node %s is alive again", node_id)
            node.last_seen = time.time()
            node.heartbeat = beat.model_dump_json().encode()
            node.healthy, node.problem, node.dead = beat.healthy, beat.problem, False

        try:
            data = await self._store.update_node(node_id, change, self._settings.node_ttl_s)
        except StoreUnavailable:
            self.blind()  # the node beat; its lease could not be renewed
            raise
        if data is None:
            return None
        if not beat.healthy:
            await self._lifecycle.fail_rooms_of(node_id, "unhealthy")
        return self._registry.read(data)

    async def drain(self, node_id: str) -> Node | None:
        """Place nothing more on the node; its rooms in flight go on."""

        def change(node: NodeData) -> None:
            if not node.draining:
                log.info("node %s drains: no more rooms are placed on it", node_id)
            node.draining = True

        data = await self._store.update_node(node_id, change)
        return self._registry.read(data) if data is not None else None

    async def forget(self, node_id: str, cause: str = "operator") -> None:
        """The node left: whatever it still held fails, it is no longer listed, and its sockets close
        (one that comes back at the same address, with another key, gets new ones)."""
        node = await self._registry.node(node_id)
        self._left.labels(cause).inc()
        await self._lifecycle.fail_rooms_of(node_id, "left")
        await self._store.remove_node(node_id)
        self._lifecycle.writers_gone(node_id)  # what it had still to hear of is moot now
        if node is not None:
            for rank in node.reg.ranks:
                self._push.forget(rank.zmq_endpoint)
        log.info("node %s left the cluster (%s)", node_id, cause)

    def _disconnected(self, endpoint: str) -> None:
        """The connection to a node's leader dropped: its process is most likely gone. Mark it dead at
        once rather than at its TTL (a live node comes back with its next heartbeat)."""
        for node in self._registry.last_look:
            if node.leader.zmq_endpoint == endpoint and not node.data.dead:
                log.warning("lost the connection to node %s: marked dead", node.id)
                self._tasks.spawn(self._mark_dead(node.id, "lost_connection"))

    async def _mark_dead(self, node_id: str, reason: str) -> None:
        flipped = False

        def change(node: NodeData) -> None:
            nonlocal flipped
            flipped, node.dead = not node.dead, True

        await self._store.update_node(node_id, change)
        if flipped:
            self._marked_dead.labels(reason).inc()
            await self._lifecycle.fail_rooms_of(node_id, reason)

    async def reap_dead_nodes(self) -> None:
        """Mark dead the nodes silent for a TTL of this bootstrap's own watching (``Observation``)."""
        nodes = await self._registry.nodes()
        now = clock()  # after the read: a stall during it is a gap before this look
        gap = self._observation.looked(now)
        if gap is not None:
            log.warning(
                "this bootstrap watched no node for %.1fs (stopped, stalled or without its store): "
                "every node gets %.1fs to beat before it is taken for dead",
                gap,
                self._settings.node_ttl_s,
            )
        for node in nodes:
            if not node.data.dead and self._observation.silent(not node.alive, now):
                log.warning(
                    "node %s missed heartbeats for %.1fs: marked dead", node.id, self._settings.node_ttl_s
                )
                await self._mark_dead(node.id, "missed_heartbeats")
