"""What the nodes report over the bootstrap's ZMQ socket: room states and streamed tokens.

A report is taken only from the reporting node's own CURVE key: a room becomes SUCCESS here only
because its decode node said so, over its authenticated socket, with the output.
"""

import asyncio
import logging
import time

import zmq

from bootstrap import rooms
from bootstrap.lifecycle import RoomLifecycle
from bootstrap.registry import Node, Registry
from bootstrap.settings import BootstrapSettings
from bootstrap.store import RoomData, Store
from bootstrap.tasks import Tasks
from shared.errors import RejectedMessage
from shared.metrics import ServiceMetrics
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.security import Security
from shared.wire.zmq_io import bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)


class ReportIntake:
    def __init__(
        self,
        settings: BootstrapSettings,
        context: zmq.Context,
        security: Security,
        store: Store,
        registry: Registry,
        lifecycle: RoomLifecycle,
        tasks: Tasks,
        metrics: ServiceMetrics,
    ):
        self._settings = settings
        self._context = context
        self._security = security
        self._store = store
        self._registry = registry
        self._lifecycle = lifecycle
        self._tasks = tasks
        self._metrics = metrics

    async def receive(self, ready: asyncio.Event) -> None:
        sock = bind_pull(self._context, self._settings.bind_zmq_endpoint(), self._security)
        ready.set()
        try:
            await receive_forever(sock, dispatcher(self._on_message, self._metrics))
        finally:
            sock.close(0)

    def _on_message(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.RoomReports):
            node = self._reporter(msg.node_id, sender)
            self._tasks.spawn(self._apply_reports(node, msg.reports))
        elif isinstance(msg, protocol.RoomTokens):
            self._reporter(msg.node_id, sender)
            self._tasks.spawn(self._add_tokens(msg.chunks))
        else:
            raise RejectedMessage(f"the bootstrap does not take {type(msg).__name__}", kind="unexpected")

    def _reporter(self, node_id: str, sender: str | None) -> Node:
        node = self._registry.known(node_id)
        if node is None:
            raise RejectedMessage(f"report from unregistered node {node_id}", kind="unknown_node")
        if sender is not None and sender != node.report_key:
            raise RejectedMessage(f"report naming node {node_id} from another key", kind="unauthorized")
        return node

    async def _apply_reports(self, node: Node, reports: list[protocol.RoomStatus]) -> None:
        for status in reports:
            room_id = await self._store.room_of(status.transfer)
            failed: str | None = None
            before_success = False

            def change(room: RoomData, status: protocol.RoomStatus = status) -> bool:
                nonlocal failed, before_success
                index = rooms.attempt_of(room, status.transfer)
                attempt = room.attempts[index]
                if node.id not in (attempt.prefill, attempt.decode):
                    return False
                role = "prefill" if node.id == attempt.prefill else "decode"
                before_success = room.state == RoomState.SUCCESS
                failed = rooms.apply(room, index, role, status)
                return True

            try:
                room = await self._store.update_room(room_id, change) if room_id is not None else None
            except StopIteration:
                room = None
            if room is None:
                self._metrics.rejected.labels("unknown_room").inc()
                log.warning(
                    "transfer=%d report from %s for a room it does not hold",
                    status.transfer,
                    node.id,
                    extra={"room": status.transfer},
                )
                continue
            if room.state == RoomState.SUCCESS and not before_success:
                self._metrics.time_to_success.observe(time.time() - room.created)
            if failed is not None:
                await self._lifecycle.fail(room.room, failed)
            elif room.done and status.outcome is not None:
                await self._lifecycle.finished(room)

    async def _add_tokens(self, chunks: list[protocol.TokenChunk]) -> None:
        for chunk in chunks:
            room_id = await self._store.room_of(chunk.transfer)
            if room_id is not None:
                await self._store.add_tokens(room_id, chunk.offset, chunk.tokens)
