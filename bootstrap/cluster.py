"""The bootstrap's logic: places rooms, hands them to nodes, folds in reports, reaps dead nodes.

Nodes and rooms live in the store (``bootstrap.store``), so any bootstrap
sharing it can serve any request. A node's report is taken only from that
node's own CURVE key: a room becomes SUCCESS here only because its decode node
said so, over its authenticated socket, with the output.

Placement picks the decode with the most free pages that fits the room and the
prefill with the fewest rooms in flight, taking the pages atomically in the
store. A room that fits nowhere waits in a bounded queue. A room that fails
before SUCCESS for a reason that says nothing about the request (a lost node,
no capacity, a timeout) is placed again, on other nodes where there are, up to
``max_attempts`` times. Every room ends: a room not ended by its deadline ends
FAILED ``deadline``, and a node ends the rooms the cluster no longer holds.
"""

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import zmq

from bootstrap import rooms
from bootstrap.outbox import Outbox
from bootstrap.registry import Incompatible, Node, Registrations, check
from bootstrap.settings import BootstrapSettings
from bootstrap.store import Attempt, BootstrapInfo, NodeData, RoomData, StoreUnavailable, open_store
from bootstrap.tokenizer import load_tokenizer
from shared.errors import RejectedMessage
from shared.kv.layout import KVLayout
from shared.metrics import ServiceMetrics
from shared.room.states import FailureReason, RoomState
from shared.wire import protocol
from shared.wire.registration import Bootstrap, Heartbeat, NodeRegistration, Registered
from shared.wire.security import Security, ZapHandler, security_for
from shared.wire.zmq_io import PushSockets, bind_pull, dispatcher, receive_forever

log = logging.getLogger(__name__)
# Between two looks for dead nodes and rooms past their deadline.
REAP_INTERVAL_S = 0.25
DEADLINE_INTERVAL_S = 2.0
# A placed room no node has said a word about after this lost its assignments (a bootstrap
# killed while they still sat in its ZMQ I/O thread): they are sent again. A node that has
# the room drops the copy as a duplicate; a node reports a room within a fraction of this.
UNHEARD_S = 2.0
# Sent again this many times and still unheard: the attempt fails, and the room is placed again.
MAX_RESENDS = 2


class NoLiveNode(Exception):
    def __init__(self, role: str):
        super().__init__(f"no live {role} node")
        self.role = role


class NoCapacity(Exception):
    """No node has room now and the queue is full (or the wait ran out): try again later."""


class Cluster:
    def __init__(self, settings: BootstrapSettings, security: Security | None = None):
        self.settings = settings
        self.security = security or security_for(settings.zmq_security, settings.curve_key_file)
        self.join_token = settings.resolved_join_token()
        self.api_key = settings.resolved_api_key()
        self.store = open_store(settings.store, settings.room_history, settings.room_ttl_s)
        self.store.on_change = self._changed  # type: ignore[method-assign]
        self.store.on_resync = self._resync  # type: ignore[method-assign]
        self.registrations = Registrations()
        self.metrics = ServiceMetrics("bootstrap", "bootstrap")
        self.zmq = zmq.Context()
        self._zap = ZapHandler(self.zmq) if self.security.keys is not None else None
        self.push = PushSockets(self.zmq, self.security)
        self.outbox = Outbox(self.push, self._lost)
        self.id = secrets.token_hex(8)
        self.started = int(time.time())
        self.tokenizer = load_tokenizer(settings.model)
        self.healthy: str | None = None  # why the store cannot be used, or None
        self._reports_lost = False  # a report failed on the store: nodes must report again
        self._waiters: dict[int, set[asyncio.Event]] = {}
        self._capacity = asyncio.Event()  # set when some room ended: pages may be free
        self._queued = 0
        self._nodes: list[Node] = []  # the last look at the store's nodes
        self._tasks: set[asyncio.Future[Any]] = set()
        self._live_counts = {"prefill": 0, "decode": 0}
        self._in_flight = 0
        self._started = time.monotonic()
        for role in ("prefill", "decode"):
            self.metrics.gauge_function(
                f"kvroom_live_{role}_nodes",
                f"Placeable {role} nodes",
                lambda role=role: self._live_counts[role],  # type: ignore[misc]
            )
        self.metrics.gauge_function("kvroom_rooms_in_flight", "Rooms not ended", lambda: self._in_flight)
        self.metrics.gauge_function(
            "kvroom_queued_rooms", "Rooms waiting for a node to have room", lambda: self._queued
        )
        self.attempts = self.metrics.attempts

    def live_count(self, role: str) -> int:
        return self._live_counts[role]

    @property
    def in_flight_count(self) -> int:
        return self._in_flight

    @property
    def queued(self) -> int:
        return self._queued

    def sessions(self, node_id: str) -> list[str]:
        """The session ids of a node's ranks, from the last look at the nodes."""
        node = next((n for n in self._nodes if n.id == node_id), None)
        return [r.session_id for r in node.reg.ranks] if node is not None else []

    @property
    def report_endpoint(self) -> str:
        return self.settings.public_zmq_endpoint()

    def me(self) -> BootstrapInfo:
        return BootstrapInfo(self.id, self.report_endpoint, self.security.public_key)

    # -- waiting ------------------------------------------------------------------------

    def _changed(self, room: int) -> None:
        """A room changed, on this bootstrap or another: wake whoever waits on it."""
        for event in self._waiters.get(room, ()):
            event.set()

    def _resync(self) -> None:
        """Changes may have gone unheard: every waiter reads its room again."""
        for waiting in self._waiters.values():
            for event in waiting:
                event.set()

    @contextlib.asynccontextmanager
    async def watching(self, room: int) -> AsyncIterator[asyncio.Event]:
        """An event set whenever the room changes, while the block runs."""
        event = asyncio.Event()
        self._waiters.setdefault(room, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._waiters[room]
            waiting.discard(event)
            if not waiting:
                del self._waiters[room]

    async def wait(self, room_id: int, seconds: float, until: Callable[[RoomData], bool]) -> RoomData | None:
        """The room once ``until`` holds for it, or as it is when ``seconds`` ran out."""
        deadline = time.monotonic() + seconds
        async with self.watching(room_id) as event:
            while True:
                event.clear()
                room = await self.store.room(room_id)
                left = deadline - time.monotonic()
                if room is None or until(room) or left <= 0:
                    return room
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)

    # -- nodes -------------------------------------------------------------------------

    async def nodes(self) -> list[Node]:
        """Every registered node with its liveness and load, as the store has them now."""
        out = []
        for data in await self.store.nodes():
            node = self.registrations.node(data)
            node.alive = await self.store.alive(node.id)
            node.load = await self.store.load(node.id)
            out.append(node)
        self._nodes = out
        for role in self._live_counts:
            self._live_counts[role] = sum(1 for n in out if n.role == role and n.placeable)
        return out

    async def node(self, node_id: str) -> Node | None:
        data = await self.store.node(node_id)
        return self.registrations.node(data) if data is not None else None

    async def registered(self, node: Node, beat: Heartbeat | None = None) -> Registered:
        """What a node learns from a registration or heartbeat: every live bootstrap, this one first."""
        others = [b for b in await self.store.bootstraps() if b.id != self.id]
        bootstraps = [
            Bootstrap(id=b.id, report_endpoint=b.report_endpoint, public_key=b.public_key)
            for b in [self.me(), *others]
        ]
        unknown = []
        if beat is not None and beat.rooms:
            for transfer in beat.rooms:
                room_id = await self.store.room_of(transfer)
                room = await self.store.room(room_id) if room_id is not None else None
                if room is None or room.done or room.attempt.transfer != transfer:
                    unknown.append(transfer)
        return Registered(
            node_id=node.id,
            bootstraps=bootstraps,
            node_ttl_s=self.settings.node_ttl_s,
            epoch=await self.store.epoch(),
            unknown_rooms=unknown,
        )

    async def register(self, reg: NodeRegistration) -> Node:
        if self.security.keys is not None and not all(r.public_key for r in reg.ranks):
            raise Incompatible("ZMQ security is on here: every rank must give its CURVE public key")
        if reg.model.tokenizer != self.tokenizer.digest:
            raise Incompatible(
                f"tokenizer differs from the bootstrap's ({self.settings.model}): "
                f"{reg.model.tokenizer} != {self.tokenizer.digest}"
            )
        check(reg, await self.nodes())
        previous = await self.node(reg.node_id)
        now = time.time()
        data = NodeData(reg.node_id, reg.model_dump_json().encode(), now, now)
        await self.store.put_node(data, self.settings.node_ttl_s)
        if previous is not None:
            # A restarted node lost whatever it held; its old endpoints may be gone.
            await self._fail_rooms_of(previous.id, dead=True)
            for rank in previous.reg.ranks:
                self.push.forget(rank.zmq_endpoint)
        log.info("node %s registered as %s with %d rank(s)", reg.node_id, reg.role, reg.tp_size)
        node = self.registrations.node(data)
        self.push.watch(node.leader.zmq_endpoint, node.key, self._disconnected)
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

        data = await self.store.update_node(node_id, change, self.settings.node_ttl_s)
        if data is None:
            return None
        if not beat.healthy:
            await self._fail_rooms_of(node_id, dead=True)  # a broken node writes nothing more
        return self.registrations.node(data)

    async def drain(self, node_id: str) -> Node | None:
        """Place nothing more on the node; its rooms in flight go on."""

        def change(node: NodeData) -> None:
            if not node.draining:
                log.info("node %s drains: no more rooms are placed on it", node_id)
            node.draining = True

        data = await self.store.update_node(node_id, change)
        return self.registrations.node(data) if data is not None else None

    async def forget(self, node_id: str) -> None:
        """The node left: whatever it still held fails, and it is no longer listed."""
        await self._fail_rooms_of(node_id, dead=True)
        await self.store.remove_node(node_id)
        log.info("node %s left the cluster", node_id)

    def _disconnected(self, endpoint: str) -> None:
        """The connection to a node's leader dropped: its process is most likely gone. Mark it dead at
        once rather than at its TTL (a live node comes back with its next heartbeat)."""
        for node in self._nodes:
            if node.leader.zmq_endpoint == endpoint and not node.data.dead:
                log.warning("lost the connection to node %s: marked dead", node.id)
                self._spawn(self._mark_dead(node.id))

    async def _mark_dead(self, node_id: str) -> None:
        flipped = False

        def change(node: NodeData) -> None:
            nonlocal flipped
            flipped, node.dead = not node.dead, True

        await self.store.update_node(node_id, change)
        if flipped:
            await self._fail_rooms_of(node_id, dead=True)

    async def reap_dead_nodes(self) -> None:
        if time.monotonic() - self._started < self.settings.node_ttl_s:
            # Just started against a store that outlived us: nodes whose leases ran out while no
            # bootstrap answered get one TTL to heartbeat before they are taken for dead.
            return
        for node in await self.nodes():
            if not node.alive and not node.data.dead:
                log.warning(
                    "node %s missed heartbeats for %.1fs: marked dead", node.id, self.settings.node_ttl_s
                )
                await self._mark_dead(node.id)

    async def _fail_rooms_of(self, node_id: str, dead: bool) -> None:
        for room_id in await self.store.rooms_on(node_id):
            await self._fail(room_id, FailureReason.PEER_LOST, dead_node=node_id if dead else None)

    # -- rooms -------------------------------------------------------------------------

    async def _choose(
        self, room_id: int, tokens: int, max_new_tokens: int, exclude: set[str]
    ) -> tuple[Node, Node]:
        """A prefill and a decode node with room for it, their pages taken; NoLiveNode or NoCapacity."""
        nodes = await self.nodes()
        for role in ("prefill", "decode"):
            if not any(n.role == role and n.placeable for n in nodes):
                raise NoLiveNode(role)
        chosen = []
        for role, order in (("decode", lambda n: -n.free_pages), ("prefill", lambda n: n.load.rooms)):
            live = [n for n in nodes if n.role == role and n.placeable]
            # The excluded (a failed attempt's nodes) last, not never: they may be all there is room on.
            candidates = sorted((n for n in live if n.id not in exclude), key=order) + sorted(
                (n for n in live if n.id in exclude), key=order
            )
            for node in candidates:
                pages = self._pages(node, tokens, max_new_tokens)
                if node.free_pages >= pages and await self.store.reserve(
                    node.id, pages, node.reg.num_pages, room_id
                ):
                    chosen.append(node)
                    break
            else:
                for node in chosen:
                    await self.store.release(node.id, self._pages(node, tokens, max_new_tokens), room_id)
                raise NoCapacity(f"no {role} node has room for {tokens} tokens now")
        decode, prefill = chosen
        return prefill, decode

    @staticmethod
    def _pages(node: Node, tokens: int, max_new_tokens: int) -> int:
        return KVLayout(1, 1, 1, node.reg.model.page_size).room_pages(node.role, tokens, max_new_tokens)

    async def _placed(
        self, room_id: int, tokens: int, max_new_tokens: int, exclude: set[str]
    ) -> tuple[Node, Node]:
        """``_choose``, waiting in the bounded queue while no node has room."""
        try:
            return await self._choose(room_id, tokens, max_new_tokens, exclude)
        except NoCapacity:
            if self._queued >= self.settings.queue_limit:
                raise
        self._queued += 1
        deadline = time.monotonic() + self.settings.max_wait_s
        try:
            while True:
                self._capacity.clear()
                with contextlib.suppress(TimeoutError):
                    # Woken when a room ends here; another bootstrap's rooms end unseen, hence the poll.
                    await asyncio.wait_for(self._capacity.wait(), 0.05)
                try:
                    return await self._choose(room_id, tokens, max_new_tokens, exclude)
                except NoCapacity:
                    if time.monotonic() > deadline:
                        raise
        finally:
            self._queued -= 1

    async def place(
        self, input_ids: list[int], max_new_tokens: int, stop: list[str], stream: bool
    ) -> RoomData:
        room_id = rooms.new_id()
        prefill, decode = await self._placed(room_id, len(input_ids), max_new_tokens, set())
        room = RoomData(room_id, input_ids, max_new_tokens, stop, stream, time.time())
        room.attempts = [Attempt(room_id, prefill.id, decode.id, placed_at=time.time())]
        room.timestamps = {RoomState.BOOTSTRAPPING.name: room.created}
        room.decode_pages = self._pages(decode, len(input_ids), max_new_tokens)
        room.prefill_pages = self._pages(prefill, len(input_ids), max_new_tokens)
        while not await self.store.create_room(room):  # an id another bootstrap just took
            room.room = room.attempt.transfer = rooms.new_id()
        await self.store.link_transfer(room.room, room.room)
        self.metrics.transitioned(RoomState.BOOTSTRAPPING.name)
        self.attempts.inc()
        log.info(
            "room=%d placed prefill=%s decode=%s tokens=%d",
            room.room,
            prefill.id,
            decode.id,
            len(input_ids),
            extra={"room": room.room},
        )
        self._in_flight += 1
        self._assign(room, prefill, decode)
        # Answered only once the nodes' assignments left: a bootstrap killed after answering
        # must not take a placed room's only copy with it.
        await self.outbox.flushed()
        return room

    def _assign(self, room: RoomData, prefill: Node, decode: Node) -> None:
        transfer, ids = room.attempt.transfer, room.input_ids
        self.outbox.room(
            prefill.leader, protocol.PrefillRoom(transfer, ids, decode.id, decode.peers), room.room
        )
        self.outbox.room(
            decode.leader,
            protocol.DecodeRoom(
                transfer, len(ids), room.max_new_tokens, prefill.id, prefill.peers, room.stop, room.stream
            ),
            room.room,
        )

    def _lost(self, room_ids: list[int]) -> None:
        """Rooms whose assignment could not be queued to one of their nodes."""
        for room_id in dict.fromkeys(room_ids):
            self._spawn(self._fail(room_id, FailureReason.PEER_LOST))

    async def abort(self, room_id: int) -> bool:
        return await self._fail(room_id, FailureReason.ABORTED, final=True)

    async def _fail(
        self, room_id: int, reason: str, dead_node: str | None = None, final: bool = False
    ) -> bool:
        """End the room's current attempt with ``reason``: place it again if it may be, else end it."""
        retry = False
        ended: Attempt | None = None

        def change(room: RoomData) -> bool:
            nonlocal retry, ended
            if room.done:
                return False
            ended = room.attempt
            retry = not final and rooms.replaceable(room, reason, self.settings.max_attempts)
            if dead_node is not None and room.state == RoomState.SUCCESS:
                room.partial = True  # its decode was lost mid-way
            if retry:
                rooms.fail_attempt(room, reason)
                rooms.add_attempt(room, Attempt(0, "", ""))  # to be placed
            else:
                rooms.end(room, reason)
            return True

        room = await self.store.update_room(room_id, change)
        if room is None or ended is None:
            return False
        for node_id in (ended.prefill, ended.decode):
            if node_id and node_id != dead_node:
                await self._abort_on(node_id, ended.transfer, reason, peer_gone=dead_node is not None)
        await self._release(room, ended)
        if retry:
            # Other nodes than the failed attempt's when there are any: a node that just failed a
            # room may be breaking, before its heartbeat says so.
            self._spawn(self._place_again(room, reason, {n for n in (ended.prefill, ended.decode) if n}))
        else:
            self._count_end(room)
        return True

    async def _place_again(self, room: RoomData, reason: str, exclude: set[str]) -> None:
        """Another placement for a room whose attempt failed for a reason that is not the request's."""
        try:
            prefill, decode = await self._placed(room.room, len(room.input_ids), room.max_new_tokens, exclude)
        except (NoLiveNode, NoCapacity, StoreUnavailable) as exc:
            log.warning("room=%d cannot be placed again: %s", room.room, exc, extra={"room": room.room})
            ended = await self.store.update_room(room.room, lambda r: rooms.end(r, reason))
            if ended is not None and ended.done:
                self._count_end(ended)
            return
        transfer = rooms.new_id()
        decode_pages = self._pages(decode, len(room.input_ids), room.max_new_tokens)
        prefill_pages = self._pages(prefill, len(room.input_ids), room.max_new_tokens)

        def change(r: RoomData) -> bool:
            if r.done:
                return False
            r.attempt.transfer, r.attempt.prefill, r.attempt.decode = transfer, prefill.id, decode.id
            r.attempt.placed_at = time.time()
            r.decode_pages, r.prefill_pages = decode_pages, prefill_pages
            return True

        await self.store.link_transfer(transfer, room.room)
        placed = await self.store.update_room(room.room, change)
        if placed is None or placed.attempt.transfer != transfer:  # ended meanwhile (aborted)
            await self.store.release(decode.id, decode_pages, room.room)
            await self.store.release(prefill.id, prefill_pages, room.room)
            return
        log.info(
            "room=%d attempt %d placed prefill=%s decode=%s",
            room.room,
            len(placed.attempts),
            prefill.id,
            decode.id,
            extra={"room": room.room},
        )
        self.attempts.inc()
        self.metrics.replacements.labels(reason).inc()
        self._assign(placed, prefill, decode)

    async def _release(self, room: RoomData, attempt: Attempt) -> None:
        """The attempt's pages on both nodes are theirs again, by the bootstraps' account."""
        if attempt.decode:
            await self.store.release(attempt.decode, room.decode_pages, room.room)
        if attempt.prefill:
            await self.store.release(attempt.prefill, room.prefill_pages, room.room)
        self._capacity.set()

    async def _abort_on(self, node_id: str, transfer: int, reason: str, peer_gone: bool = False) -> None:
        node = next((n for n in self._nodes if n.id == node_id), None) or await self.node(node_id)
        if node is not None:
            self.outbox.abort(
                node.leader, protocol.AbortRoom(room=transfer, rank=0, reason=reason, peer_gone=peer_gone)
            )

    def _count_end(self, room: RoomData) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        state = "FAILED" if room.outcome == "failed" or room.state == RoomState.FAILED else "SUCCESS"
        self.metrics.room_seconds.labels(state).observe(time.time() - room.created)
        self.metrics.transitioned(state)
        if state == "FAILED":
            self.metrics.failures.labels(room.reason or "unknown").inc()

    # -- reports -----------------------------------------------------------------------

    def _reporter(self, node_id: str, sender: str | None) -> Node:
        node = next((n for n in self._nodes if n.id == node_id), None)
        if node is None:
            raise RejectedMessage(f"report from unregistered node {node_id}", kind="unknown_node")
        if sender is not None and sender != node.key:
            raise RejectedMessage(f"report naming node {node_id} from another key", kind="unauthorized")
        return node

    def on_reports(self, msg: protocol.RoomReports, sender: str | None) -> None:
        node = self._reporter(msg.node_id, sender)
        self._spawn(self._apply_reports(node, msg.reports))

    async def _apply_reports(self, node: Node, reports: list[protocol.RoomStatus]) -> None:
        for status in reports:
            room_id = await self.store.room_of(status.room)
            failed: str | None = None
            before_success = False

            def change(room: RoomData, status: protocol.RoomStatus = status) -> bool:
                nonlocal failed, before_success
                index = rooms.attempt_of(room, status.room)
                attempt = room.attempts[index]
                if node.id not in (attempt.prefill, attempt.decode):
                    return False
                role = "prefill" if node.id == attempt.prefill else "decode"
                before_success = room.state == RoomState.SUCCESS
                failed = rooms.apply(room, index, role, status)
                return True

            try:
                room = await self.store.update_room(room_id, change) if room_id is not None else None
            except StopIteration:
                room = None
            if room is None:
                self.metrics.rejected.labels("unknown_room").inc()
                log.warning(
                    "room=%d report from %s for a room it does not hold",
                    status.room,
                    node.id,
                    extra={"room": status.room},
                )
                continue
            if room.state == RoomState.SUCCESS and not before_success:
                self.metrics.time_to_success.observe(time.time() - room.created)
            if failed is not None:
                await self._fail(room.room, failed)
            elif room.done and status.outcome is not None:
                await self._release(room, room.attempt)
                self._count_end(room)

    def on_tokens(self, msg: protocol.RoomTokens, sender: str | None) -> None:
        node = self._reporter(msg.node_id, sender)
        self._spawn(self._add_tokens(node, msg.chunks))

    async def _add_tokens(self, node: Node, chunks: list[protocol.TokenChunk]) -> None:
        for chunk in chunks:
            room_id = await self.store.room_of(chunk.room)
            if room_id is not None:
                await self.store.add_tokens(room_id, chunk.offset, chunk.tokens)

    # -- loops -----------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: "asyncio.Future[Any]") -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, StoreUnavailable):
                log.warning("store unavailable: %s", exc)
                self._reports_lost = True
            else:
                log.error("task failed", exc_info=exc)

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

    async def watch(self) -> None:
        """Announce this bootstrap, reap dead nodes, end rooms past their deadline; watch the store."""
        last_deadline = 0.0
        while True:
            try:
                await self.store.announce(self.me(), max(3.0, self.settings.node_ttl_s))
                await self.reap_dead_nodes()
                if time.monotonic() - last_deadline > DEADLINE_INTERVAL_S:
                    last_deadline = time.monotonic()
                    await self._check_in_flight()
                if self.healthy is not None or self._reports_lost:
                    log.warning("the store is back: nodes report their rooms again")
                    self._reports_lost = False
                    await self.store.epoch(renew=True)
                self.healthy = None
            except StoreUnavailable as exc:
                if self.healthy is None:
                    log.error("the store is unavailable: %s", exc)
                self.healthy = str(exc)
            await asyncio.sleep(REAP_INTERVAL_S)

    async def _check_in_flight(self) -> None:
        """End the rooms past their deadline; send again the assignments no node has heard of."""
        now = time.time()
        for room_id in await self.store.in_flight():
            room = await self.store.room(room_id)
            if room is None or room.done:
                continue
            if room.created < now - self.settings.room_deadline_s:
                await self._fail(room_id, FailureReason.DEADLINE, final=True)
            elif rooms.unheard(room, now, UNHEARD_S):
                await self._unheard(room)

    async def _unheard(self, room: RoomData) -> None:
        """Send the room's assignments again, or fail its attempt once they were sent again enough."""
        attempt = room.attempt
        if attempt.resent >= MAX_RESENDS:
            await self._fail(room.room, FailureReason.PEER_LOST)
            return
        prefill, decode = await self.node(attempt.prefill), await self.node(attempt.decode)
        if prefill is None or decode is None or prefill.data.dead or decode.data.dead:
            return  # the dead node's rooms are failed or placed again where it is reaped
        resend = False

        def change(r: RoomData) -> bool:
            # Decided in the store: a room aborted, reported on or placed again meanwhile is left be.
            nonlocal resend
            now = time.time()
            resend = r.attempt.transfer == attempt.transfer and rooms.unheard(r, now, UNHEARD_S)
            if resend:
                r.attempt.placed_at, r.attempt.resent = now, r.attempt.resent + 1
            return resend

        updated = await self.store.update_room(room.room, change)
        if updated is None or not resend:
            return
        log.warning(
            "room=%d no node has reported on it: its assignments are sent again",
            room.room,
            extra={"room": room.room},
        )
        self.metrics.resent_assignments.inc()
        self._assign(updated, prefill, decode)  # no await since the decision: nothing overtakes it

    async def start(self) -> None:
        self._started = time.monotonic()
        await self.store.start()
        with contextlib.suppress(StoreUnavailable):
            await self.nodes()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.store.close()
        self.push.close()
        if self._zap is not None:
            self._zap.close()
        self.zmq.term()
