"""Where a room goes: the placeable decode with the most free pages that fits it and the prefill with
the fewest rooms in flight, their pages taken atomically in the store. A room that fits nowhere now
waits in a bounded queue until a room ends or its wait runs out; one larger than every pool of a
role in service is refused at once, since no wait would place it."""

import asyncio
import contextlib
import time

from bootstrap.registry import Node, Registry
from bootstrap.settings import BootstrapSettings
from bootstrap.store import Store
from shared.kv.layout import KVLayout
from shared.metrics import ServiceMetrics
from shared.wire.protocol import RoomId

# Between two looks for room in the queue: another bootstrap's rooms end unseen here.
QUEUE_POLL_S = 0.05


class NoLiveNode(Exception):
    def __init__(self, role: str):
        super().__init__(f"no live {role} node")
        self.role = role


class NoCapacity(Exception):
    """No node has room now and the queue is full (or the wait ran out): try again later."""


class NeverFits(Exception):
    """The room needs more pages than any node of a role in service has in all."""


def room_pages(node: Node, tokens: int, max_new_tokens: int) -> int:
    """The pages a room of ``tokens`` and ``max_new_tokens`` holds on ``node``."""
    return KVLayout(1, 1, 1, node.reg.model.page_size).room_pages(node.role, tokens, max_new_tokens)


class Placement:
    def __init__(
        self, settings: BootstrapSettings, store: Store, registry: Registry, metrics: ServiceMetrics
    ):
        self._settings = settings
        self._store = store
        self._registry = registry
        self._capacity = asyncio.Event()  # set when some room ended: pages may be free
        self._queued = 0
        metrics.gauge_function(
            "kvroom_queued_rooms", "Rooms waiting for a node to have room", lambda: self._queued
        )

    @property
    def queued(self) -> int:
        return self._queued

    def freed(self) -> None:
        """A room's pages went back to its nodes: a queued room may fit now."""
        self._capacity.set()

    async def choose(
        self, room_id: RoomId, tokens: int, max_new_tokens: int, exclude: set[str]
    ) -> tuple[Node, Node]:
        """``_take``, waiting in the bounded queue while no node has room."""
        try:
            return await self._take(room_id, tokens, max_new_tokens, exclude)
        except NoCapacity:
            if self._queued >= self._settings.queue_limit:
                raise
        self._queued += 1
        deadline = time.monotonic() + self._settings.max_wait_s
        try:
            while True:
                self._capacity.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._capacity.wait(), QUEUE_POLL_S)
                try:
                    return await self._take(room_id, tokens, max_new_tokens, exclude)
                except NoCapacity:
                    if time.monotonic() > deadline:
                        raise
        finally:
            self._queued -= 1

    async def _take(
        self, room_id: RoomId, tokens: int, max_new_tokens: int, exclude: set[str]
    ) -> tuple[Node, Node]:
        """A prefill and a decode node with room for it, their pages taken; NoLiveNode or NoCapacity
        (also while every node of a role is only late: a beat delayed on a busy host is no death,
        and the node TTL ends the wait if it is one)."""
        nodes = await self._registry.nodes()
        for role in ("prefill", "decode"):
            serving = [n for n in nodes if n.role == role and n.in_service]
            if not serving:
                raise NoLiveNode(role)
            roomiest = max(serving, key=lambda n: n.reg.num_pages - room_pages(n, tokens, max_new_tokens))
            need = room_pages(roomiest, tokens, max_new_tokens)
            if need > roomiest.reg.num_pages:
                raise NeverFits(
                    f"a room of {tokens} prompt tokens and {max_new_tokens} new tokens needs {need} KV "
                    f"pages on a {role} node, and the largest {role} pool has {roomiest.reg.num_pages}"
                )
        chosen = []
        for role, order in (("decode", lambda n: -n.free_pages), ("prefill", lambda n: n.load.rooms)):
            live = [n for n in nodes if n.role == role and n.placeable]
            # The excluded (a failed attempt's nodes) last, not never: they may be all there is room on.
            candidates = sorted((n for n in live if n.id not in exclude), key=order) + sorted(
                (n for n in live if n.id in exclude), key=order
            )
            for node in candidates:
                pages = room_pages(node, tokens, max_new_tokens)
                if node.free_pages >= pages and await self._store.reserve(
                    node.id, pages, node.reg.num_pages, room_id
                ):
                    chosen.append(node)
                    break
            else:
                for node in chosen:
                    await self._store.release(node.id, room_pages(node, tokens, max_new_tokens), room_id)
                if not live:
                    raise NoCapacity(f"every {role} node is late with its heartbeat")
                raise NoCapacity(f"no {role} node has room for {tokens} tokens now")
        decode, prefill = chosen
        return prefill, decode
