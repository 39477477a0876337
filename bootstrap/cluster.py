"""The bootstrap's logic: places rooms, hands them to nodes, folds in reports, reaps dead nodes.

A node's report is taken only from that node's own CURVE key: a room becomes
SUCCESS here only because its decode node said so, over its authenticated
socket, with the output.
"""

import asyncio
import logging
import secrets
import time

import zmq

from bootstrap.registry import Incompatible, Node, NodeRegistry
from bootstrap.rooms import RoomBook, RoomRecord
from bootstrap.settings import BootstrapSettings
from bootstrap.tokenizer import load_tokenizer
from shared import protocol
from shared.errors import RejectedMessage
from shared.metrics import ServiceMetrics
from shared.registration import NodeRegistration, Registered
from shared.security import Security, ZapHandler, security_for
from shared.states import FailureReason, RoomState
from shared.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)


class NoLiveNode(Exception):
    def __init__(self, role: str):
        super().__init__(f"no live {role} node")
        self.role = role


class Cluster:
    def __init__(self, settings: BootstrapSettings, security: Security | None = None):
        self.settings = settings
        self.security = security or security_for(settings.zmq_security, settings.curve_key_file)
        self.join_token = settings.resolved_join_token()
        self.api_key = settings.resolved_api_key()
        self.registry = NodeRegistry(settings.node_ttl_s)
        self.book = RoomBook(settings.room_history)
        self.metrics = ServiceMetrics("bootstrap", "bootstrap")
        self.metrics.count_states(lambda: [r.state for r in self.book.rooms.values()])
        for role in ("prefill", "decode"):
            self.metrics.gauge_function(
                f"kvroom_live_{role}_nodes",
                f"Live {role} nodes",
                lambda role=role: self.registry.live_count(role),  # type: ignore[misc]
            )
        self.zmq = zmq.Context()
        self._zap = ZapHandler(self.zmq) if self.security.keys is not None else None
        self.push = PushSockets(self.zmq, self.security)
        self.id = secrets.token_hex(8)  # changes with every start: nodes report their rooms again
        self.started = int(time.time())
        self.tokenizer = load_tokenizer(settings.model)

    @property
    def report_endpoint(self) -> str:
        return self.settings.public_zmq_endpoint()

    def registered(self, node: Node) -> Registered:
        """What a node learns from a registration or heartbeat."""
        return Registered(
            node_id=node.id,
            report_endpoint=self.report_endpoint,
            bootstrap_keys=[self.security.public_key] if self.security.keys else [],
            report_key=self.security.public_key,
            node_ttl_s=self.settings.node_ttl_s,
            bootstrap_id=self.id,
        )

    # -- nodes -------------------------------------------------------------------------

    def register(self, reg: NodeRegistration) -> Node:
        if self.security.keys is not None and not all(r.public_key for r in reg.ranks):
            raise Incompatible("ZMQ security is on here: every rank must give its CURVE public key")
        if reg.model.tokenizer != self.tokenizer.digest:
            raise Incompatible(
                f"tokenizer differs from the bootstrap's ({self.settings.model}): "
                f"{reg.model.tokenizer} != {self.tokenizer.digest}"
            )
        node, previous = self.registry.register(reg)
        if previous is not None:
            # A restarted node lost whatever it held; its old endpoints may be gone.
            for record in [self.book.rooms[r] for r in previous.rooms if r in self.book.rooms]:
                self._fail(record, FailureReason.PEER_LOST, dead=previous)
            for rank in previous.reg.ranks:
                self.push.forget(rank.zmq_endpoint)
        return node

    def heartbeat_changed(self, node: Node) -> None:
        """A node said it cannot serve: its rooms fail now, not at its TTL."""
        if not node.healthy:
            self._fail_rooms_of(node)

    def drain(self, node: Node) -> None:
        """Place nothing more on ``node``; its rooms in flight go on."""
        if not node.draining:
            log.info("node %s drains: no more rooms are placed on it", node.id)
        node.draining = True

    def forget(self, node: Node) -> None:
        """The node left: whatever it still held fails, and it is no longer listed."""
        self._fail_rooms_of(node)
        self.registry.nodes.pop(node.id, None)
        log.info("node %s left the cluster", node.id)

    def reap_dead_nodes(self) -> None:
        for node in self.registry.expire():
            self._fail_rooms_of(node)

    def _fail_rooms_of(self, node: Node) -> None:
        for room_id in list(node.rooms):
            record = self.book.rooms.get(room_id)
            if record is not None:
                self._fail(record, FailureReason.PEER_LOST, dead=node)

    # -- rooms -------------------------------------------------------------------------

    def place(self, input_ids: list[int], max_new_tokens: int, stop: list[str], stream: bool) -> RoomRecord:
        prefill = self.registry.pick("prefill")
        if prefill is None:
            raise NoLiveNode("prefill")
        decode = self.registry.pick("decode")
        if decode is None:
            raise NoLiveNode("decode")
        record = RoomRecord(
            self.book.new_id(), input_ids, max_new_tokens, prefill, decode, self.tokenizer.decode
        )
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
        room = record.id
        sent = self._send(
            prefill.leader, protocol.PrefillRoom(room, input_ids, decode.id, decode.peers)
        ) and self._send(
            decode.leader,
            protocol.DecodeRoom(
                room, len(input_ids), max_new_tokens, prefill.id, prefill.peers, stop, stream
            ),
        )
        if not sent:
            self._fail(record, FailureReason.PEER_LOST)
        return record

    def abort(self, record: RoomRecord) -> bool:
        return self._fail(record, FailureReason.ABORTED)

    def _fail(self, record: RoomRecord, reason: str, dead: Node | None = None) -> bool:
        if not self.book.fail(record, reason):
            return False
        self._count_end(record)
        for node in (record.prefill, record.decode):
            if node is not dead:
                self._abort_on(node, record, reason, peer_gone=dead is not None)
        return True

    def _abort_on(self, node: Node, record: RoomRecord, reason: str, peer_gone: bool = False) -> None:
        self._send(
            node.leader, protocol.AbortRoom(room=record.id, rank=0, reason=reason, peer_gone=peer_gone)
        )

    def _send(self, peer: protocol.PeerRank, msg: protocol.Message) -> bool:
        return self.push.send(peer.zmq_endpoint, peer.public_key, protocol.encode(msg))

    def _count_end(self, record: RoomRecord) -> None:
        state = "FAILED" if record.outcome == "failed" else record.state.name
        self.metrics.room_seconds.labels(state).observe(time.monotonic() - record.placed_at)
        self.metrics.transitions.labels(state).inc()
        if state == "FAILED":
            self.metrics.failures.labels(record.reason or "unknown").inc()

    def _reporter(self, node_id: str, sender: str | None) -> Node:
        node = self.registry.nodes.get(node_id)
        if node is None:
            raise RejectedMessage(f"report from unregistered node {node_id}", kind="unknown_node")
        if sender is not None and sender != node.key:
            raise RejectedMessage(f"report naming node {node_id} from another key", kind="unauthorized")
        return node

    def on_reports(self, msg: protocol.RoomReports, sender: str | None) -> None:
        node = self._reporter(msg.node_id, sender)
        for status in msg.reports:
            record = self.book.rooms.get(status.room)
            if record is None or node not in (record.prefill, record.decode):
                self.metrics.rejected.labels("unknown_room").inc()
                log.warning(
                    "room=%d report from %s for a room it does not hold",
                    status.room,
                    msg.node_id,
                    extra={"room": status.room},
                )
                continue
            was_done, was_success = record.done.is_set(), record.state is RoomState.SUCCESS
            role = "prefill" if node is record.prefill else "decode"
            for other in self.book.apply(record, role, status):
                self._abort_on(other, record, record.reason or "")
            if record.state is RoomState.SUCCESS and not was_success:
                self.metrics.time_to_success.observe(time.monotonic() - record.placed_at)
            if record.done.is_set() and not was_done:
                self._count_end(record)

    def on_tokens(self, msg: protocol.RoomTokens, sender: str | None) -> None:
        node = self._reporter(msg.node_id, sender)
        for chunk in msg.chunks:
            record = self.book.rooms.get(chunk.room)
            if record is not None and record.decode is node:
                record.add_tokens(chunk.offset, chunk.tokens)

    # -- loops -----------------------------------------------------------------------

    async def receive_reports(self, ready: asyncio.Event) -> None:
        sock = bind_pull(self.zmq, self.settings.bind_zmq_endpoint(), self.security)
        ready.set()
        try:
            await receive_forever(sock, dispatcher(self._on_message, self.metrics))
        finally:
            sock.close(0)

    def _on_message(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.RoomReports):
            self.on_reports(msg, sender)
        elif isinstance(msg, protocol.RoomTokens):
            self.on_tokens(msg, sender)
        else:
            raise RejectedMessage(f"the bootstrap does not take {type(msg).__name__}", kind="unexpected")

    async def watch_nodes(self) -> None:
        while True:
            self.reap_dead_nodes()
            await asyncio.sleep(min(1.0, self.settings.node_ttl_s / 4))

    def close(self) -> None:
        self.push.close()
        if self._zap is not None:
            self._zap.close()
        self.zmq.term()
