"""Rank 0's process speaks for the node: it hands the bootstrap's assignments to every rank in
one order, folds the ranks' states into agreed ones, and watches that every rank lives.

The other ranks are separate processes linked to it by ``ipc://`` sockets in a
private directory (``RankLinks``). A node that lost a rank is broken as a
whole: its rooms fail ``peer_lost``, its health says so, and the bootstrap stops
placing rooms on it.
"""

import logging
import os
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from shared.cli import VERSION
from shared.kv import tcp_drain
from shared.node import agreement
from shared.node.membership import Membership, Standing
from shared.node.rank import ASSIGNMENTS, RankService, assignments_in, refuse_assignment
from shared.node.reports import BootstrapLink
from shared.room.states import FailureReason
from shared.wire import protocol
from shared.wire.registration import Heartbeat, NodeRegistration, RankStatus
from shared.wire.security import Security
from shared.wire.zmq_io import PushSockets, bind_pull

log = logging.getLogger(__name__)
# Rooms held this long are named in heartbeats: the bootstrap says which it no longer holds.
SWEEP_AGE_S = 10.0


def leader_endpoint(directory: Path) -> str:
    return f"ipc://{directory}/leader"


def rank_endpoint(directory: Path, rank: int) -> str:
    return f"ipc://{directory}/rank{rank}"


class RankLinks:
    """The leader's end of the ipc sockets to ranks 1..n-1 (no CURVE: the directory is private)."""

    def __init__(self, context: zmq.Context, directory: Path, world: int):
        self.directory = directory
        self.pull = bind_pull(context, leader_endpoint(directory))
        self._push = PushSockets(context, Security(None))
        self._ranks = range(1, world)

    def send(self, rank: int, msg: protocol.Message) -> None:
        self._push.send(rank_endpoint(self.directory, rank), "", protocol.encode(msg))

    def broadcast(self, msg: protocol.Message) -> None:
        frames = protocol.encode(msg)
        for rank in self._ranks:
            self._push.send(rank_endpoint(self.directory, rank), "", frames)

    def close(self) -> None:
        self.pull.close(0)
        self._push.close()


class NodeLeader:
    """The node as one: what rank 0's service reports through, and what the bootstrap talks to."""

    def __init__(
        self,
        role: str,
        node_id: str,
        service: RankService,
        link: BootstrapLink,
        world: int,
        links: RankLinks | None,
        pids: dict[int, int | None],
    ):
        self.role = role
        self.node_id = node_id
        self.service = service
        self.rank = rank = service.rank
        self.link = link
        self.world = world
        self.links = links
        self.ranks: dict[int, protocol.PeerRank] = {0: rank.info()}
        self.health_of: dict[int, protocol.RankHealth] = {}
        self.health_at: dict[int, float] = {}  # when each rank's last health came (monotonic)
        self.alive: dict[int, bool] = {r: r == 0 for r in range(world)}
        self.pids = {0: os.getpid(), **pids}
        self.broken: str | None = None
        self.draining = False

    # -- the bootstrap's assignments ------------------------------------------------------

    def on_message(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        """Everything that reaches rank 0's network socket: the bootstrap's assignments and aborts
        go to every rank; the rest is the service's."""
        from_bootstrap = self.link.is_bootstrap(sender)
        if isinstance(msg, ASSIGNMENTS) or (isinstance(msg, protocol.AbortRoom) and from_bootstrap):
            if not from_bootstrap:
                refuse_assignment(msg, sender)
            self.service.take_each(assignments_in(msg), self.assign)
        else:
            self.service.on_message(msg, aux, sender)

    def assign(self, msg: protocol.PrefillRoom | protocol.DecodeRoom | protocol.AbortRoom) -> None:
        """Give every rank the same assignment, in the order they came: the order of their collectives.

        A draining node refuses a room it has not seen before any rank takes it: the room ends
        FAILED ``draining`` here, and the bootstrap places it elsewhere.
        """
        rooms = self.service.rooms
        if self.draining and not isinstance(msg, protocol.AbortRoom) and rooms.find(msg.transfer) is None:
            log.info("transfer=%d refused: the node drains", msg.transfer, extra={"room": msg.transfer})
            self.service.metrics.failures.labels(FailureReason.DRAINING).inc()
            self.link.report(rooms.ended_unseen(msg.transfer, FailureReason.DRAINING))
            return
        if self.links is not None:
            self.links.broadcast(msg)
        self.service.handle_assignment(msg)
        if self.broken is not None and not isinstance(msg, protocol.AbortRoom):
            self.assign(protocol.AbortRoom(transfer=msg.transfer, rank=0, reason=FailureReason.PEER_LOST))

    # -- the other ranks -----------------------------------------------------------------

    def on_rank_message(self, msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.RankStates):
            if isinstance(self.service.agree, agreement.LeaderParticipant):
                self.service.agree.contribute(msg.rank, msg.states)
        elif isinstance(msg, protocol.RankHealth):
            self.health_of[msg.rank] = msg
            self.health_at[msg.rank] = time.monotonic()
        elif isinstance(msg, protocol.RankReady):
            p = msg.peer
            self.ranks[p.rank] = p
            self.alive[p.rank] = True
            log.info("rank %d ready: engine %s, zmq %s", p.rank, p.session_id, p.zmq_endpoint)

    @property
    def ready(self) -> bool:
        return len(self.ranks) == self.world

    def orphaned(self, rooms: list[protocol.TransferId]) -> None:
        """Rooms the cluster no longer holds (its bootstrap forgot them): nobody waits for them."""
        for room in rooms:
            if room in self.service.rooms.live:
                self.assign(protocol.AbortRoom(transfer=room, rank=0, reason=FailureReason.ORPHANED))

    def rank_died(self, rank: int, how: str) -> None:
        """A rank process ended: the node cannot serve any more; every room it holds fails."""
        self.alive[rank] = False
        if self.broken is None:
            self.broken = f"rank {rank} {how}"
            log.error("%s: the node is broken; failing its rooms", self.broken)
        for room in list(self.service.rooms.live):
            self.assign(protocol.AbortRoom(transfer=room, rank=0, reason=FailureReason.PEER_LOST))

    # -- what the node says about itself ---------------------------------------------------

    def registration(self) -> NodeRegistration:
        return NodeRegistration(
            node_id=self.node_id,
            role=self.role,  # type: ignore[arg-type]
            http_url=self.rank.settings.public_http_url,
            version=VERSION,
            ranks=[self.ranks[r] for r in range(self.world)],
            model=self.rank.source.identity,
            num_pages=self.rank.pool.num_pages,
            verify_kv=self.rank.settings.verify_kv,
            heartbeat_interval_s=self.rank.settings.heartbeat_interval_s,
        )

    def _rank_health(self) -> list[protocol.RankHealth]:
        own = self.service.health()
        return [own, *(self.health_of[r] for r in range(1, self.world) if r in self.health_of)]

    def heartbeat(self) -> Heartbeat:
        healths = self._rank_health()
        old = time.time() - SWEEP_AGE_S
        return Heartbeat(
            rooms_in_flight=len(self.service.rooms.live),
            transfers=[r.id for r in self.service.rooms.live.values() if r.timestamps["BOOTSTRAPPING"] < old][
                :4096
            ],
            free_pages=min(h.free_pages for h in healths),
            healthy=self.broken is None,
            problem=self.broken,
            ranks=[
                RankStatus(
                    rank=h.rank,
                    alive=self.alive.get(h.rank, False),
                    free_pages=h.free_pages,
                    free_aux_slots=h.free_aux_slots,
                )
                for h in healths
            ],
        )

    def problem(self, membership: Membership) -> str | None:
        """Why the node cannot take rooms now, or None."""
        if self.broken is not None:
            return self.broken
        if self.draining:
            return "draining"
        if membership.standing is not Standing.REGISTERED:
            return membership.problem
        return None

    def health(self, membership: Membership) -> dict[str, Any]:
        healths = self._rank_health()
        problem = self.problem(membership)
        return {
            "status": "ok" if problem is None else "unavailable",
            "problem": problem,
            "node_id": self.node_id,
            "role": self.role,
            "version": VERSION,
            "registered": membership.registered.is_set(),
            "standing": membership.standing.value,
            "zmq_security": "curve" if self.rank.security.keys else "plain",
            "tp_size": self.world,
            "rooms_in_flight": len(self.service.rooms.live),
            "free_pages": min(h.free_pages for h in healths),
            "total_pages": self.rank.pool.num_pages,
            "free_aux_slots": min(h.free_aux_slots for h in healths),
            "total_aux_slots": healths[0].total_aux_slots,
            "fenced_rooms": sum(h.fenced_rooms for h in healths),
            "fenced_pages": sum(h.fenced_pages for h in healths),
            "lent_pages_closed": {
                how: sum(getattr(h, f"lent_pages_{how}") for h in healths)
                for how in ("returned", "revoked", "expired")
            },
            "ranks": [
                {
                    **msgspec.structs.asdict(self.ranks[r]),
                    "alive": self.alive.get(r, False),
                    "pid": self.pids.get(r),
                    **(
                        {
                            k: getattr(h, k)
                            for k in ("free_pages", "free_aux_slots", "rooms_in_flight", "fenced_rooms")
                        }
                        if (h := next((x for x in healths if x.rank == r), None))
                        else {}
                    ),
                }
                for r in sorted(self.ranks)
            ],
        }

    def rooms_in_flight(self) -> int:
        return sum(h.rooms_in_flight + h.fenced_rooms for h in self._rank_health())

    def writes_over(self, since: float) -> bool:
        """Whether no write to peers may still move: by what every rank still alive said after
        ``since`` (an older word may predate a write), and, for a dead rank's writes over TCP, by
        the host's kernel, which goes on sending what the dead process's sockets held."""
        live = [r for r in range(1, self.world) if self.alive.get(r, False)]
        if any(self.health_at.get(r, float("-inf")) <= since for r in live):
            return False
        healths = [self.service.health(), *(self.health_of[r] for r in live)]
        if any(h.writes_in_flight for h in healths):
            return False
        some_died = len(live) < self.world - 1
        return not (some_died and self.rank.settings.transport == "tcp") or tcp_drain.dead_writes_sent()
