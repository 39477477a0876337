"""Nodes joining, beating, draining and leaving: the cluster's membership as the store keeps it.

A node missing heartbeats past its TTL, or whose connection dropped, is marked dead; a node that
says it is broken, registers again (a restart) or leaves is lost as well: the rooms it held fail
(``RoomLifecycle.fail_rooms_of``), and are placed again where they may be.
"""

import logging
import time

from bootstrap.lifecycle import RoomLifecycle
from bootstrap.registry import Incompatible, Node, Registry, check
from bootstrap.settings import BootstrapSettings
from bootstrap.store import BootstrapInfo, NodeData, Store
from bootstrap.tasks import Tasks
from shared.wire.registration import Bootstrap, Heartbeat, NodeRegistration, Registered
from shared.wire.security import Security
from shared.wire.zmq_io import PushSockets

log = logging.getLogger(__name__)


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
        self._started = time.monotonic()

    def start(self) -> None:
        """Nodes are taken for dead only a TTL after this."""
        self._started = time.monotonic()

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
        now = time.time()
        data = NodeData(reg.node_id, reg.model_dump_json().encode(), now, now)
        await self._store.put_node(data, self._settings.node_ttl_s)
        if previous is not None:
            # A restarted node lost whatever it held; its old endpoints may be gone.
            await self._lifecycle.fail_rooms_of(previous.id)
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

        data = await self._store.update_node(node_id, change, self._settings.node_ttl_s)
        if data is None:
            return None
        if not beat.healthy:
            await self._lifecycle.fail_rooms_of(node_id)  # a broken node writes nothing more
        return self._registry.read(data)

    async def drain(self, node_id: str) -> Node | None:
        """Place nothing more on the node; its rooms in flight go on."""

        def change(node: NodeData) -> None:
            if not node.draining:
                log.info("node %s drains: no more rooms are placed on it", node_id)
            node.draining = True

        data = await self._store.update_node(node_id, change)
        return self._registry.read(data) if data is not None else None

    async def forget(self, node_id: str) -> None:
        """The node left: whatever it still held fails, and it is no longer listed."""
        await self._lifecycle.fail_rooms_of(node_id)
        await self._store.remove_node(node_id)
        log.info("node %s left the cluster", node_id)

    def _disconnected(self, endpoint: str) -> None:
        """The connection to a node's leader dropped: its process is most likely gone. Mark it dead at
        once rather than at its TTL (a live node comes back with its next heartbeat)."""
        for node in self._registry.last_look:
            if node.leader.zmq_endpoint == endpoint and not node.data.dead:
                log.warning("lost the connection to node %s: marked dead", node.id)
                self._tasks.spawn(self._mark_dead(node.id))

    async def _mark_dead(self, node_id: str) -> None:
        flipped = False

        def change(node: NodeData) -> None:
            nonlocal flipped
            flipped, node.dead = not node.dead, True

        await self._store.update_node(node_id, change)
        if flipped:
            await self._lifecycle.fail_rooms_of(node_id)

    async def reap_dead_nodes(self) -> None:
        if time.monotonic() - self._started < self._settings.node_ttl_s:
            # Just started against a store that outlived us: nodes whose leases ran out while no
            # bootstrap answered get one TTL to heartbeat before they are taken for dead.
            return
        for node in await self._registry.nodes():
            if not node.alive and not node.data.dead:
                log.warning(
                    "node %s missed heartbeats for %.1fs: marked dead", node.id, self._settings.node_ttl_s
                )
                await self._mark_dead(node.id)
