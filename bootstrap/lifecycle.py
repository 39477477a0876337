"""A room from its placement to its end: handed to its nodes, failed, placed again, its pages released.

A room that fails before SUCCESS for a reason that says nothing about the request (a lost node, no
capacity, a timeout) is placed again, on other nodes where there are, up to ``max_attempts`` times.
Every room ends: a room not ended by its deadline ends FAILED ``deadline``, and a placed room no node
has reported on has its assignments sent again, then its attempt fails. On vLLM nodes an attempt
is two HTTP requests to the nodes' OpenAI servers (``bootstrap.vllm_driver``) instead of ZMQ
assignments, and ending the attempt cancels them.
"""

import logging
import time

from prometheus_client import Counter

from bootstrap import rooms
from bootstrap.outbox import Outbox
from bootstrap.placement import NeverFits, NoCapacity, NoLiveNode, Placement, room_pages
from bootstrap.registry import Node, Registry
from bootstrap.settings import BootstrapSettings
from bootstrap.store import Attempt, RoomData, Store, StoreUnavailable
from bootstrap.tasks import Tasks
from bootstrap.vllm_driver import VllmDriver
from bootstrap.waiters import Waiters
from shared.metrics import ServiceMetrics
from shared.room.states import FailureReason, RoomState
from shared.wire import protocol
from shared.wire.registration import MAX_WRITERS_GONE
from shared.wire.zmq_io import PushSockets

log = logging.getLogger(__name__)
# A placed room no node has said a word about after this lost its assignments (a bootstrap
# killed while they still sat in its ZMQ I/O thread): they are sent again. A node that has
# the room drops the copy as a duplicate; a node reports a room within a fraction of this.
UNHEARD_S = 2.0
# Sent again this many times and still unheard: the attempt fails, and the room is placed again.
MAX_RESENDS = 2
# How the bootstrap learned that a node is lost. Only these say that its process can write no more
# (docs/failures.md, "One rule for death"), so that its peers may free at once the pages it could
# write; silence, a dropped control socket or an unhealthy beat move its rooms elsewhere, and
# their pages stay fenced until the writer gives them back or the lease runs out.
WRITES_ENDED = frozenset({"left", "restarted"})
# Failed attempts remembered per prefill node, whose decodes may keep pages fenced for its writes
# until it is known to write no more: then they are told. Older ones have had their lease run out.
FENCED_REMEMBERED = 4096


class RoomLifecycle:
    def __init__(
        self,
        settings: BootstrapSettings,
        store: Store,
        registry: Registry,
        placement: Placement,
        push: PushSockets,
        tasks: Tasks,
        metrics: ServiceMetrics,
        waiters: Waiters,
    ):
        self._settings = settings
        self._store = store
        self._registry = registry
        self._placement = placement
        self._tasks = tasks
        self._metrics = metrics
        # Prefill node -> its failed attempts' transfers and their decode nodes.
        self._fenced_for: dict[str, dict[protocol.TransferId, str]] = {}
        # vLLM decode node -> transfers whose writers are gone, until its next heartbeat's answer.
        self._writers_gone: dict[str, list[protocol.TransferId]] = {}
        self._node_losses = Counter(
            "kvroom_rooms_failed_by_node_loss_total",
            "Room attempts failed because one of their nodes was lost, by the evidence: "
            "missed_heartbeats, lost_connection, unhealthy, registered_again (these fence the "
            "room's pages until the lease ends), left or restarted (these free them at once)",
            ["evidence"],
            registry=metrics.registry,
        )
        self._outbox = Outbox(push, self._lost)
        self._vllm = VllmDriver(
            settings,
            store,
            waiters,
            tasks,
            lambda room_id, reason, transfer: self.fail(room_id, reason, transfer=transfer),
            self.finished,
        )
        self._in_flight = 0
        metrics.gauge_function("kvroom_rooms_in_flight", "Rooms not ended", lambda: self._in_flight)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def place(
        self, input_ids: list[int], max_new_tokens: int, stop: list[str], stream: bool
    ) -> RoomData:
        """Place a new room and hand it to its nodes; NoLiveNode, NeverFits or NoCapacity if it cannot."""
        room_id = protocol.RoomId(rooms.new_id())
        prefill, decode = await self._placement.choose(room_id, len(input_ids), max_new_tokens, set())
        room = RoomData(
            room=room_id,
            input_ids=input_ids,
            max_new_tokens=max_new_tokens,
            stop=stop,
            stream=stream,
            created=time.time(),
        )
        # The first placement's transfer id is the room's own.
        room.attempts = [Attempt(protocol.TransferId(room_id), prefill.id, decode.id, placed_at=time.time())]
        room.timestamps = {RoomState.BOOTSTRAPPING.name: room.created}
        room.decode_pages = room_pages(decode, len(input_ids), max_new_tokens)
        room.prefill_pages = room_pages(prefill, len(input_ids), max_new_tokens)
        while not await self._store.create_room(room):  # an id another bootstrap just took
            room.room = protocol.RoomId(rooms.new_id())
            room.attempt.transfer = protocol.TransferId(room.room)
        await self._store.link_transfer(room.attempt.transfer, room.room)
        self._metrics.transitioned(RoomState.BOOTSTRAPPING.name)
        self._metrics.attempts.inc()
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
        await self._outbox.flushed()
        return room

    def _assign(self, room: RoomData, prefill: Node, decode: Node) -> None:
        if prefill.reg.is_vllm or decode.reg.is_vllm:
            self._vllm.start(room, prefill, decode)  # requests to their OpenAI servers
            return
        transfer, ids = room.attempt.transfer, room.input_ids
        self._outbox.room(
            prefill.leader, protocol.PrefillRoom(transfer, ids, decode.id, decode.peers), room.room
        )
        self._outbox.room(
            decode.leader,
            protocol.DecodeRoom(
                transfer, len(ids), room.max_new_tokens, prefill.id, prefill.peers, room.stop, room.stream
            ),
            room.room,
        )

    def _lost(self, room_ids: list[protocol.RoomId]) -> None:
        """Rooms whose assignment could not be queued to one of their nodes."""
        for room_id in dict.fromkeys(room_ids):
            self._tasks.spawn(self.fail(room_id, FailureReason.PEER_LOST))

    async def abort(self, room_id: protocol.RoomId) -> bool:
        return await self.fail(room_id, FailureReason.ABORTED, final=True)

    async def fail_rooms_of(
        self, node_id: str, evidence: str, held: set[protocol.RoomId] | None = None
    ) -> None:
        """The node is lost (``evidence`` says how we know): each of its rooms' attempts fails (those
        in ``held``, where given), and is placed again where it may be."""
        writes_ended = evidence in WRITES_ENDED
        if writes_ended:  # the rooms that failed before, however, need no fence any more
            for transfer, decode in self._fenced_for.pop(node_id, {}).items():
                await self._abort_on(decode, transfer, FailureReason.PEER_LOST, peer_gone=True)
        for room_id in held if held is not None else await self._store.rooms_on(node_id):
            failed = await self.fail(room_id, FailureReason.PEER_LOST, node_id, writes_ended)
            if failed:
                self._node_losses.labels(evidence).inc()

    async def fail(
        self,
        room_id: protocol.RoomId,
        reason: str,
        dead_node: str | None = None,
        writes_ended: bool = False,
        final: bool = False,
        transfer: protocol.TransferId | None = None,
    ) -> bool:
        """End the room's current attempt with ``reason``: place it again if it may be, else end it.
        With ``transfer``, only if that is still the current attempt's. ``writes_ended``: the dead
        node can write no more, so its peers need not keep the room's pages fenced."""
        retry = False
        ended: Attempt | None = None

        def change(room: RoomData) -> bool:
            nonlocal retry, ended
            if room.done or (transfer is not None and room.attempt.transfer != transfer):
                return False
            ended = room.attempt
            retry = not final and rooms.replaceable(room, reason, self._settings.max_attempts)
            if dead_node is not None and room.state == RoomState.SUCCESS:
                room.partial = True  # its decode was lost mid-way
            if retry:
                rooms.fail_attempt(room, reason)
                rooms.add_attempt(room, Attempt(protocol.TransferId(0), "", ""))  # to be placed
            else:
                rooms.end(room, reason)
            return True

        room = await self._store.update_room(room_id, change)
        if room is None or ended is None:
            return False
        # On vLLM nodes: closing the attempt's requests makes vLLM abort them (a dead node's too).
        self._vllm.cancel(ended.transfer)
        for node_id in (ended.prefill, ended.decode):
            if node_id and node_id != dead_node:
                await self._abort_on(node_id, ended.transfer, reason, peer_gone=writes_ended)
        if not writes_ended:
            self._remember_fenced(ended)
        await self._release(room, ended)
        if retry:
            # Other nodes than the failed attempt's when there are any: a node that just failed a
            # room may be breaking, before its heartbeat says so.
            exclude = {n for n in (ended.prefill, ended.decode) if n}
            self._tasks.spawn(self._place_again(room, reason, exclude))
        else:
            self._count_end(room)
        return True

    async def _place_again(self, room: RoomData, reason: str, exclude: set[str]) -> None:
        """Another placement for a room whose attempt failed for a reason that is not the request's."""
        tokens = len(room.input_ids)
        try:
            prefill, decode = await self._placement.choose(room.room, tokens, room.max_new_tokens, exclude)
        except (NoLiveNode, NeverFits, NoCapacity, StoreUnavailable) as exc:
            log.warning("room=%d cannot be placed again: %s", room.room, exc, extra={"room": room.room})
            ended = await self._store.update_room(room.room, lambda r: rooms.end(r, reason))
            if ended is not None and ended.done:
                self._count_end(ended)
            return
        transfer = protocol.TransferId(rooms.new_id())
        decode_pages = room_pages(decode, tokens, room.max_new_tokens)
        prefill_pages = room_pages(prefill, tokens, room.max_new_tokens)

        def change(r: RoomData) -> bool:
            if r.done:
                return False
            r.attempt.transfer, r.attempt.prefill, r.attempt.decode = transfer, prefill.id, decode.id
            r.attempt.placed_at = time.time()
            r.decode_pages, r.prefill_pages = decode_pages, prefill_pages
            return True

        await self._store.link_transfer(transfer, room.room)
        placed = await self._store.update_room(room.room, change)
        if placed is None or placed.attempt.transfer != transfer:  # ended meanwhile (aborted)
            await self._store.release(decode.id, decode_pages, room.room)
            await self._store.release(prefill.id, prefill_pages, room.room)
            return
        log.info(
            "room=%d attempt %d placed prefill=%s decode=%s",
            room.room,
            len(placed.attempts),
            prefill.id,
            decode.id,
            extra={"room": room.room},
        )
        self._metrics.attempts.inc()
        self._metrics.replacements.labels(reason).inc()
        self._assign(placed, prefill, decode)

    async def finished(self, room: RoomData) -> None:
        """The room ended on its nodes' report: its pages go back, and its end is counted."""
        if room.failed:
            self._remember_fenced(room.attempt)
        await self._release(room, room.attempt)
        self._count_end(room)

    async def _release(self, room: RoomData, attempt: Attempt) -> None:
        """The attempt's pages on both nodes are theirs again, by the bootstraps' account."""
        if attempt.decode:
            await self._store.release(attempt.decode, room.decode_pages, room.room)
        if attempt.prefill:
            await self._store.release(attempt.prefill, room.prefill_pages, room.room)
        self._placement.freed()

    def _remember_fenced(self, attempt: Attempt) -> None:
        if not (attempt.prefill and attempt.decode):
            return
        fenced = self._fenced_for.setdefault(attempt.prefill, {})
        fenced[attempt.transfer] = attempt.decode
        if len(fenced) > FENCED_REMEMBERED:
            del fenced[next(iter(fenced))]

    async def _abort_on(
        self, node_id: str, transfer: protocol.TransferId, reason: str, peer_gone: bool = False
    ) -> None:
        node = self._registry.known(node_id) or await self._registry.node(node_id)
        if node is None:
            return
        if not node.reg.is_vllm:
            self._outbox.abort(
                node.leader, protocol.AbortRoom(transfer=transfer, rank=0, reason=reason, peer_gone=peer_gone)
            )
        elif peer_gone and node.reg.role == "decode":
            # A vLLM server's attempt is cancelled in fail(); that its writers are gone it hears in
            # its next heartbeat's answer.
            gone = self._writers_gone.setdefault(node_id, [])
            gone.append(transfer)
            del gone[:-MAX_WRITERS_GONE]

    def writers_gone(self, node_id: str) -> list[protocol.TransferId]:
        """The vLLM decode server's transfers whose writers are gone, since it was last told."""
        return self._writers_gone.pop(node_id, [])

    async def close(self) -> None:
        await self._vllm.close()

    def _count_end(self, room: RoomData) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        state = "FAILED" if room.failed else "SUCCESS"
        self._metrics.room_seconds.labels(state).observe(time.time() - room.created)
        self._metrics.transitioned(state)
        if state == "FAILED":
            self._metrics.failures.labels(room.reason or "unknown").inc()

    async def sweep(self) -> None:
        """End the rooms past their deadline; send again the assignments no node has heard of."""
        now = time.time()
        for room_id in await self._store.in_flight():
            room = await self._store.room(room_id)
            if room is None or room.done:
                continue
            if room.created < now - self._settings.room_deadline_s:
                await self.fail(room_id, FailureReason.DEADLINE, final=True)
            elif rooms.unheard(room, now, UNHEARD_S):
                await self._unheard(room)

    async def _unheard(self, room: RoomData) -> None:
        """Send the room's assignments again, or fail its attempt once they were sent again enough."""
        attempt = room.attempt
        if attempt.resent >= MAX_RESENDS:
            await self.fail(room.room, FailureReason.PEER_LOST)
            return
        prefill = await self._registry.node(attempt.prefill)
        decode = await self._registry.node(attempt.decode)
        if prefill is None or decode is None or prefill.data.dead or decode.data.dead:
            return  # the dead node's rooms are failed or placed again where it is reaped
        if prefill.reg.is_vllm or decode.reg.is_vllm:
            return  # its requests are in flight, and fail the attempt if they cannot be made
        resend = False

        def change(r: RoomData) -> bool:
            # Decided in the store: a room aborted, reported on or placed again meanwhile is left be.
            nonlocal resend
            now = time.time()
            resend = r.attempt.transfer == attempt.transfer and rooms.unheard(r, now, UNHEARD_S)
            if resend:
                r.attempt.placed_at, r.attempt.resent = now, r.attempt.resent + 1
            return resend

        updated = await self._store.update_room(room.room, change)
        if updated is None or not resend:
            return
        log.warning(
            "room=%d no node has reported on it: its assignments are sent again",
            room.room,
            extra={"room": room.room},
        )
        self._metrics.resent_assignments.inc()
        self._assign(updated, prefill, decode)  # no await since the decision: nothing overtakes it
