"""The bootstrap's logic: places rooms, hands them to nodes, folds in reports, reaps dead nodes."""

import asyncio
import logging
import secrets

import zmq

from bootstrap.registry import Node, NodeRegistration, NodeRegistry
from bootstrap.rooms import RoomBook, RoomRecord
from bootstrap.settings import BootstrapSettings
from shared import protocol
from shared.errors import ProtocolError
from shared.metrics import ServiceMetrics
from shared.states import FailureReason, RoomState
from shared.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)


class NoLiveNode(Exception):
    def __init__(self, role: str):
        super().__init__(f"no live {role} node")
        self.role = role


class Cluster:
    def __init__(self, settings: BootstrapSettings):
        self.settings = settings
        self.registry = NodeRegistry(settings.node_ttl_s)
        self.book = RoomBook(settings.room_history)
        self.metrics = ServiceMetrics("bootstrap")
        self.metrics.count_states(lambda: [r.state for r in self.book.rooms.values()])
        for role in ("prefill", "decode"):
            self.metrics.gauge_function(
                f"kvroom_live_{role}_nodes",
                f"Live {role} nodes",
                lambda role=role: self.registry.live_count(role),  # type: ignore[misc]
            )
        self.zmq = zmq.Context()
        self.push = PushSockets(self.zmq)
        # Nodes take room assignments and aborts only when they carry this token.
        self.token = secrets.token_hex(16)

    @property
    def report_endpoint(self) -> str:
        return self.settings.public_zmq_endpoint()

    # -- nodes -------------------------------------------------------------------------

    def register(self, reg: NodeRegistration) -> Node:
        node, previous = self.registry.register(reg)
        if previous is not None:
            # A restarted node lost whatever it held; its old endpoints may be gone.
            for record in [self.book.rooms[r] for r in previous.rooms if r in self.book.rooms]:
                self._fail(record, FailureReason.PEER_LOST)
            for rank in previous.reg.ranks:
                self.push.forget(rank.zmq_endpoint)
        return node

    def reap_dead_nodes(self) -> None:
        for node in self.registry.expire():
            for room_id in list(node.rooms):
                record = self.book.rooms.get(room_id)
                if record is not None:
                    self._fail(record, FailureReason.PEER_LOST)

    # -- rooms -------------------------------------------------------------------------

    def place(self, input_ids: list[int], max_new_tokens: int) -> RoomRecord:
        prefill = self.registry.pick("prefill")
        if prefill is None:
            raise NoLiveNode("prefill")
        decode = self.registry.pick("decode")
        if decode is None:
            raise NoLiveNode("decode")
        record = RoomRecord(self.book.new_id(), input_ids, max_new_tokens, prefill, decode)
        self.book.add(record)
        self.metrics.transitions.labels(RoomState.BOOTSTRAPPING.name).inc()
        log.info(
            "room=%d placed prefill=%s decode=%s tokens=%d",
            record.id,
            prefill.id,
            decode.id,
            len(input_ids),
            extra={"room": record.id},
        )
        room, token = record.id, self.token
        sent = all(
            self._send(peer, protocol.PrefillRoom(room, peer.rank, token, input_ids, decode.id, decode.peers))
            for peer in prefill.peers
        ) and all(
            self._send(
                peer,
                protocol.DecodeRoom(
                    room, peer.rank, token, len(input_ids), max_new_tokens, prefill.id, prefill.peers
                ),
            )
            for peer in decode.peers
        )
        if not sent:
            self._fail(record, FailureReason.PEER_LOST)
        return record

    def abort(self, record: RoomRecord) -> bool:
        return self._fail(record, FailureReason.ABORTED)

    def _fail(self, record: RoomRecord, reason: str) -> bool:
        if not self.book.fail(record, reason):
            return False
        self._count_end(record)
        for node in (record.prefill, record.decode):
            self._abort_on(node, record, reason)
        return True

    def _abort_on(self, node: Node, record: RoomRecord, reason: str) -> None:
        for peer in node.peers:
            self._send(
                peer, protocol.AbortRoom(room=record.id, rank=peer.rank, token=self.token, reason=reason)
            )

    def _send(self, peer: protocol.PeerRank, msg: protocol.Message) -> bool:
        return self.push.send(peer.zmq_endpoint, protocol.encode(msg))

    def _count_end(self, record: RoomRecord) -> None:
        self.metrics.transitions.labels(record.state.name).inc()
        if record.state is RoomState.FAILED:
            self.metrics.failures.labels(record.reason or "unknown").inc()

    def on_reports(self, msg: protocol.RoomReports) -> None:
        for status in msg.reports:
            record = self.book.rooms.get(status.room)
            if record is None or msg.node_id not in (record.prefill.id, record.decode.id):
                self.metrics.rejected.labels("unknown_room").inc()
                log.warning(
                    "room=%d report from %s for a room it does not hold",
                    status.room,
                    msg.node_id,
                    extra={"room": status.room},
                )
                continue
            was_terminal = record.state.terminal
            role = "prefill" if msg.node_id == record.prefill.id else "decode"
            for node in self.book.apply(record, role, status):
                self._abort_on(node, record, record.reason or "")
            if record.state.terminal and not was_terminal:
                self._count_end(record)

    # -- loops -----------------------------------------------------------------------

    async def receive_reports(self, ready: asyncio.Event) -> None:
        sock = bind_pull(self.zmq, self.settings.bind_zmq_endpoint())
        ready.set()
        try:
            await receive_forever(sock, dispatcher(self._on_message, self.metrics))
        finally:
            sock.close(0)

    def _on_message(self, msg: protocol.Message, aux: memoryview | None) -> None:
        if not isinstance(msg, protocol.RoomReports):
            raise ProtocolError(f"the bootstrap does not take {type(msg).__name__}")
        self.on_reports(msg)

    async def watch_nodes(self) -> None:
        while True:
            self.reap_dead_nodes()
            await asyncio.sleep(min(1.0, self.settings.node_ttl_s / 4))

    def close(self) -> None:
        self.push.close()
        self.zmq.term()
