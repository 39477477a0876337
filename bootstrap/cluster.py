"""The bootstrap's logic behind the API, as one object over the collaborators that do each job.

Nodes and rooms live in the store (``bootstrap.store``), so any bootstrap sharing it can serve any
request. The jobs: the nodes as the store has them (``registry.Registry``), their membership
(``directory.NodeDirectory``), where a room goes (``placement.Placement``), a room from placement
to its end (``lifecycle.RoomLifecycle``), what the nodes report (``reports.ReportIntake``), and who
waits on a room (``waiters.Waiters``). The cluster builds them, hands the API what it asks for, and
keeps the bootstrap's upkeep loop (``watch``).
"""

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import zmq

from bootstrap.directory import NodeDirectory
from bootstrap.lifecycle import RoomLifecycle
from bootstrap.placement import Placement
from bootstrap.registry import Node, Registry
from bootstrap.reports import ReportIntake
from bootstrap.settings import BootstrapSettings
from bootstrap.store import BootstrapInfo, RoomData, StoreUnavailable, open_store
from bootstrap.tasks import Tasks
from bootstrap.tokenizer import load_tokenizer
from bootstrap.waiters import Waiters
from shared.metrics import ServiceMetrics
from shared.wire.protocol import RoomId
from shared.wire.registration import Heartbeat, NodeRegistration, Registered
from shared.wire.security import Security, ZapHandler, security_for
from shared.wire.zmq_io import PushSockets

log = logging.getLogger(__name__)
# Between two looks for dead nodes; rooms past their deadline are looked for less often.
REAP_INTERVAL_S = 0.25
DEADLINE_INTERVAL_S = 2.0


class Cluster:
    def __init__(self, settings: BootstrapSettings, security: Security | None = None):
        self.settings = settings
        self.security = security or security_for(settings.zmq_security, settings.curve_key_file)
        self.join_token = settings.resolved_join_token()
        self.api_key = settings.resolved_api_key()
        self._waiters = Waiters()
        self.store = open_store(settings.store, settings.room_history, settings.room_ttl_s, self._waiters)
        self.metrics = ServiceMetrics("bootstrap", "bootstrap")
        self._zmq = zmq.Context()
        self._zap = ZapHandler(self._zmq) if self.security.keys is not None else None
        self._push = PushSockets(self._zmq, self.security)
        self.id = secrets.token_hex(8)
        self.started = int(time.time())
        self.me = BootstrapInfo(self.id, settings.public_zmq_endpoint(), self.security.public_key)
        self.tokenizer = load_tokenizer(settings.model)
        self.healthy: str | None = None  # why the store cannot be used, or None
        self._tasks = Tasks()
        self._registry = Registry(self.store, self.metrics)
        self._placement = Placement(settings, self.store, self._registry, self.metrics)
        self._lifecycle = RoomLifecycle(
            settings,
            self.store,
            self._registry,
            self._placement,
            self._push,
            self._tasks,
            self.metrics,
            self._waiters,
        )
        self._directory = NodeDirectory(
            settings,
            self.me,
            self.security,
            self.tokenizer.digest,
            self.store,
            self._registry,
            self._lifecycle,
            self._push,
            self._tasks,
            self.metrics,
        )
        self._reports = ReportIntake(
            settings,
            self._zmq,
            self.security,
            self.store,
            self._registry,
            self._lifecycle,
            self._tasks,
            self.metrics,
        )

    # -- what the API reads ---------------------------------------------------------------

    def live_count(self, role: str) -> int:
        return self._registry.live_count(role)

    @property
    def in_flight_count(self) -> int:
        return self._lifecycle.in_flight

    @property
    def queued(self) -> int:
        return self._placement.queued

    def sessions(self, node_id: str) -> list[str]:
        return self._registry.sessions(node_id)

    def watching(self, room: RoomId) -> contextlib.AbstractAsyncContextManager[asyncio.Event]:
        return self._waiters.watching(room)

    async def wait(
        self, room_id: RoomId, seconds: float, until: Callable[[RoomData], bool]
    ) -> RoomData | None:
        return await self._waiters.wait(self.store, room_id, seconds, until)

    # -- nodes ------------------------------------------------------------------------------

    async def nodes(self) -> list[Node]:
        return await self._registry.nodes()

    async def node(self, node_id: str) -> Node | None:
        return await self._registry.node(node_id)

    async def registered(self, node: Node, beat: Heartbeat | None = None) -> Registered:
        return await self._directory.registered(node, beat)

    async def register(self, reg: NodeRegistration) -> Node:
        return await self._directory.register(reg)

    async def heartbeat(self, node_id: str, beat: Heartbeat) -> Node | None:
        return await self._directory.heartbeat(node_id, beat)

    async def drain(self, node_id: str) -> Node | None:
        return await self._directory.drain(node_id)

    async def forget(self, node_id: str, cause: str = "operator") -> None:
        await self._directory.forget(node_id, cause)

    # -- rooms ------------------------------------------------------------------------------

    async def place(
        self, input_ids: list[int], max_new_tokens: int, stop: list[str], stream: bool
    ) -> RoomData:
        return await self._lifecycle.place(input_ids, max_new_tokens, stop, stream)

    async def abort(self, room_id: RoomId) -> bool:
        return await self._lifecycle.abort(room_id)

    def abort_soon(self, room_id: RoomId) -> None:
        """Abort the room without waiting: its client is gone (a stream cut mid-way)."""
        self._tasks.spawn(self.abort(room_id))

    # -- running ----------------------------------------------------------------------------

    async def receive_reports(self, ready: asyncio.Event) -> None:
        await self._reports.receive(ready)

    async def watch(self) -> None:
        """Announce this bootstrap, reap dead nodes, end rooms past their deadline; watch the store."""
        last_deadline = 0.0
        while True:
            try:
                await self.store.announce(self.me, max(3.0, self.settings.node_ttl_s))
                await self._directory.reap_dead_nodes()
                if time.monotonic() - last_deadline > DEADLINE_INTERVAL_S:
                    last_deadline = time.monotonic()
                    await self._lifecycle.sweep()
                reports_lost = self._tasks.store_failed()
                if self.healthy is not None or reports_lost:
                    log.warning("the store is back: nodes report their rooms again")
                    await self.store.epoch(renew=True)
                self.healthy = None
            except StoreUnavailable as exc:
                if self.healthy is None:
                    log.error("the store is unavailable: %s", exc)
                self.healthy = str(exc)
                self._directory.blind()
            await asyncio.sleep(REAP_INTERVAL_S)

    async def start(self) -> None:
        self._directory.start()
        await self.store.start()
        with contextlib.suppress(StoreUnavailable):
            await self._registry.nodes()

    async def close(self) -> None:
        self._tasks.cancel()
        await self._lifecycle.close()
        await self.store.close()
        self._push.close()
        if self._zap is not None:
            self._zap.close()
        self._zmq.term()
