"""A node, assembled in one place, in dependency order, with every dependency handed in.

rank (engine, pool, model source, sockets) → agreement participant → the role's
service → leader (rank 0 only) → membership (rank 0 only). Nothing is wired to
anything after it is built: what a part needs from one built after it, it is
given as a call at run time (``Node.health``), never as an attribute set later.

The process side (signals, rank processes, the HTTP server) is
``shared.node.runtime``; a program of its own can build a rank here with its own
engine, pool and loop.
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from shared.kv.pool import KVPool
from shared.kv.transfer import MooncakeEngine, TransferEngine
from shared.metrics import ServiceMetrics
from shared.models.source import KVSource
from shared.node import agreement
from shared.node.leader import NodeLeader, RankLinks
from shared.node.membership import Membership
from shared.node.rank import AgreementFactory, Peers, Rank, RankService, Reports
from shared.node.reports import BootstrapLink
from shared.node.settings import NodeSettings
from shared.room.states import FailureReason
from shared.wire import protocol
from shared.wire.security import Security
from shared.wire.zmq_io import dispatcher, receive_forever

log = logging.getLogger(__name__)

# A draining node's calls to the bootstrap (it drains, it leaves) wait at most this long each.
LEAVE_TIMEOUT_S = 1.0
# The longest a stopping node waits for the writes of the rooms it failed to end before it leaves.
WRITES_SETTLE_S = 2.0


def _no_gauges(metrics: ServiceMetrics, node: "Node") -> None:
    pass


@dataclass(frozen=True)
class Role:
    """What makes a node a prefill or a decode node: its service, its settings, its own gauges."""

    name: str
    service: type[RankService]
    settings: type[NodeSettings]
    gauges: Callable[[ServiceMetrics, "Node"], None] = _no_gauges


def make_rank(
    settings: NodeSettings,
    index: int,
    source: KVSource,
    security: Security,
    engine: TransferEngine | None = None,
    pool: KVPool | None = None,
    peers: Peers | None = None,
) -> Rank:
    """A rank with its pool registered with its engine; both are made from the settings unless given."""
    engine = engine or MooncakeEngine(
        settings.engine_host or settings.public_host,
        settings.transport,
        settings.rdma_devices,
        advertise_host=settings.public_host,
    )
    pool = pool or KVPool(
        source.kv_layout(settings.page_size),
        settings.num_pages,
        settings.rank_device(index),
        scatter=settings.scatter_pages,
    )
    engine.register(pool.base_ptr, pool.nbytes)
    return Rank(settings, index, source, security, engine, pool, peers)


def agreement_for(
    settings: NodeSettings,
    loop: asyncio.AbstractEventLoop,
    index: int,
    *,
    broadcast: Callable[[protocol.Message], None] | None = None,
    to_leader: Callable[[protocol.Message], None] | None = None,
    group: object = None,
) -> AgreementFactory:
    """How rank ``index`` of this node agrees: alone, through rank 0's leader (ipc), or over gloo."""
    world = settings.tp_size
    if world == 1:
        return agreement.Solo
    if settings.agreement == "gloo":
        return functools.partial(agreement.GlooParticipant, loop, index, world, group)
    if index == 0:
        assert broadcast is not None
        return functools.partial(agreement.LeaderParticipant, loop, world, broadcast)
    assert to_leader is not None
    return functools.partial(agreement.FollowerParticipant, loop, index, to_leader)


def build_service(
    role: Role,
    rank: Rank,
    reports: Reports,
    agree: AgreementFactory,
    metrics: ServiceMetrics,
    loop: asyncio.AbstractEventLoop,
) -> RankService:
    return role.service(rank, reports, agree, metrics, loop)


class Node:
    """Rank 0 of a node and what speaks for the node: the leader and the membership."""

    def __init__(
        self,
        role: Role,
        settings: NodeSettings,
        rank: Rank,
        loop: asyncio.AbstractEventLoop,
        links: RankLinks | None = None,
        pids: dict[int, int | None] | None = None,
        group: object = None,
    ):
        self.role = role
        self.settings = settings
        self.stopping = asyncio.Event()  # set by a signal, or by a rank's death: ``serve`` drains
        self.node_id = node_id = settings.resolved_node_id(role.name)
        self.rank = rank
        self.links = links
        self.metrics = metrics = ServiceMetrics(role.name, node_id, settings.transport)
        self.link = BootstrapLink(node_id, rank.push.send, loop)
        broadcast = links.broadcast if links is not None else None
        agree = agreement_for(settings, loop, 0, broadcast=broadcast, group=group)
        self.service = service = build_service(role, rank, self.link, agree, metrics, loop)
        self.link.live = service.rooms.live
        self.leader = leader = NodeLeader(
            role.name, node_id, service, self.link, settings.tp_size, links, pids or {}
        )
        self.membership = Membership(
            settings,
            node_id,
            self.link,
            leader.registration,
            leader.heartbeat,
            lambda: [*service.rooms.live.values(), *service.rooms.finished.values()],
            leader.orphaned,
        )
        metrics.count_states(service.rooms.states)
        metrics.gauge_function(
            "kvroom_free_pages", "Free KV pages (the fewest of any rank)", lambda: self.health()["free_pages"]
        )
        metrics.gauge_function(
            "kvroom_total_pages", "KV pages in each rank's pool", lambda: rank.pool.num_pages
        )
        role.gauges(metrics, self)

    def health(self) -> dict[str, Any]:
        return self.leader.health(self.membership)

    def rank_died(self, rank: int, how: str) -> None:
        self.leader.rank_died(rank, how)
        self.membership.beat_now()  # the bootstrap stops placing rooms here now, not at the next beat
        if not self.settings.stay_up_on_rank_death:
            log.error("the node leaves the cluster and exits, for its supervisor to start it again")
            self.stop()

    def stop(self) -> None:
        """Refuse rooms not seen yet from this moment, before the drain begins; then drain."""
        self.leader.draining = True
        self.stopping.set()

    async def serve(self) -> None:
        """Take rooms until ``stopping`` is set, then drain; the other ranks must be started."""
        stop = self.stopping
        service, metrics = self.service, self.metrics
        pull = self.rank.bind()
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [
                    tg.create_task(
                        receive_forever(pull, dispatcher(self.leader.on_message, metrics), service.urgent)
                    ),
                    tg.create_task(service.background()),
                ]
                if self.links is not None:
                    on_rank = dispatcher(self.leader.on_rank_message, metrics)
                    loops.append(tg.create_task(receive_forever(self.links.pull, on_rank)))
                    while not self.leader.ready and not stop.is_set() and self.leader.broken is None:
                        await asyncio.sleep(0.02)
                loops.append(tg.create_task(self.membership.run()))
                await stop.wait()
                await self.drain()
                for task in loops:
                    task.cancel()
                service.cancel_tasks()
        finally:
            pull.close(0)

    async def drain(self) -> None:
        """Place nothing more here, let rooms in flight end within the grace period, fail the rest.
        The bootstrap is told with short timeouts: a slow one does not stretch the grace. A node that
        lost a rank has no grace: its rooms' collectives would wait for the dead rank for ever."""
        settings, leader, membership = self.settings, self.leader, self.membership
        grace = 0.0 if leader.broken is not None else settings.drain_grace_s
        deadline = time.monotonic() + grace
        leader.draining = True
        await membership.leave(timeout_s=LEAVE_TIMEOUT_S)
        while leader.rooms_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.service.rooms.live)
        if left:
            log.warning("drain: %d rooms still in flight after %.1fs; failing them", len(left), grace)
            for room in left:
                leader.assign(protocol.AbortRoom(transfer=room, rank=0, reason=FailureReason.SHUTDOWN))
            await asyncio.sleep(0.1)  # their ends reach the reports
        # Leaving tells the peers that this node writes no more, and they free at once the pages it
        # could write (docs/failures.md, "One rule for death"): a prefill leaves only once its
        # writes are over. Past the bound it exits without a word, and its peers wait out the lease.
        writer = self.role.name == "prefill"
        since = time.monotonic()  # every rank has had its aborts: what it says after is current
        settle = since + WRITES_SETTLE_S
        while writer and not leader.writes_over(since) and time.monotonic() < settle:
            await asyncio.sleep(0.05)
        self.link.flush()
        await asyncio.sleep(0.05)  # ZMQ sends are queued: let them leave before the sockets close
        if writer and not leader.writes_over(since):
            log.warning("drain: writes still in flight after %.1fs; exiting without leaving", WRITES_SETTLE_S)
            return
        with contextlib.suppress(httpx.HTTPError):
            async with httpx.AsyncClient(base_url=settings.bootstrap_url, timeout=LEAVE_TIMEOUT_S) as client:
                cause = "rank_death" if leader.broken is not None else "shutdown"
                await client.delete(
                    f"/nodes/{self.node_id}", params={"cause": cause}, headers=membership.auth
                )

    def close(self) -> None:
        if self.links is not None:
            self.links.close()
        self.service.shutdown()
        self.rank.close()
