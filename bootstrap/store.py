"""Where the bootstrap keeps nodes and rooms: one interface, in this process or in Redis.

Everything any bootstrap must see lives here: registrations, liveness leases,
the load placed on each node, every room with its attempts, streamed tokens,
and which bootstraps are up. A change to a room is one atomic read-modify-write
(``update_room``); every bootstrap hears of it (its ``RoomEvents``), so a client
waiting on one bootstrap sees a room another one placed. ``MemoryStore`` is the
default, embedded; Redis (``bootstrap.redis_store``) lets
bootstraps restart, or run two at once, without losing a room.
"""

import abc
import collections
import secrets
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from shared.errors import KvroomError
from shared.room.record import TransferId
from shared.wire import grants
from shared.wire.protocol import RoomId, RoomRecord

Change = Callable[["RoomData"], bool]  # mutates the room; True if it changed anything


class StoreUnavailable(KvroomError):
    """The store cannot be reached: the bootstrap answers 503 until it can again."""


class Attempt(msgspec.Struct):
    """One placement of a room; the nodes know it by ``transfer``."""

    transfer: TransferId
    prefill: str
    decode: str
    state: int = 1
    reason: str | None = None
    node_states: dict[str, dict[str, object]] = {}
    placed_at: float = 0.0  # wall clock when its assignments were last sent
    resent: int = 0  # times they were sent again, no node having reported on it


class RoomData(RoomRecord, kw_only=True):
    """Everything the bootstrap knows of a room: its request, its placements, and its record (the
    current attempt's, from its decode's reports)."""

    room: RoomId
    input_ids: list[int]
    max_new_tokens: int
    stop: list[str]
    stream: bool
    created: float  # wall clock
    attempts: list[Attempt] = []
    partial: bool = False  # the decode was lost mid-way: output_ids is what it had streamed
    # Both nodes' timings, merged: more keys than one report may carry.
    timings: dict[str, float] = {}
    done: bool = False
    decode_pages: int = 0  # reserved on the decode node while the room is in flight
    prefill_pages: int = 0

    @property
    def attempt(self) -> Attempt:
        return self.attempts[-1]


class NodeData(msgspec.Struct):
    """A registered node: its registration (JSON, as the node sent it) and how it is doing."""

    node_id: str
    registration: bytes
    registered_at: float
    last_seen: float  # wall clock of its last heartbeat
    heartbeat: bytes = b"{}"
    healthy: bool = True
    problem: str | None = None
    draining: bool = False
    dead: bool = False  # its lease ran out; set once, by the bootstrap that saw it first


class BootstrapInfo(msgspec.Struct):
    id: str
    report_endpoint: str
    public_key: str
    seen: float = 0.0


class Load(msgspec.Struct):
    """What the rooms placed on a node hold, by the bootstraps' own account."""

    pages: int = 0
    rooms: int = 0


class RoomEvents(Protocol):
    """Who hears what the store tells of rooms, given to the store when it is made."""

    def changed(self, room: RoomId) -> None:
        """A room changed, on this bootstrap or another."""

    def resync(self) -> None:
        """Changes may have gone unheard (the event channel was lost and is back): read every room again."""


class Store(abc.ABC):
    """Every method may raise StoreUnavailable."""

    def __init__(self, events: RoomEvents):
        self.events = events

    # -- nodes ------------------------------------------------------------------------

    @abc.abstractmethod
    async def put_node(self, node: NodeData, lease_s: float) -> None: ...

    @abc.abstractmethod
    async def node(self, node_id: str) -> NodeData | None: ...

    @abc.abstractmethod
    async def nodes(self) -> list[NodeData]: ...

    @abc.abstractmethod
    async def update_node(
        self, node_id: str, change: Callable[[NodeData], None], lease_s: float | None = None
    ) -> NodeData | None:
        """Apply ``change`` atomically; with ``lease_s`` also renew the node's liveness lease."""

    @abc.abstractmethod
    async def alive(self, node_id: str) -> bool:
        """Whether the node's lease still runs."""

    @abc.abstractmethod
    async def remove_node(self, node_id: str) -> None: ...

    @abc.abstractmethod
    async def reserve(self, node_id: str, pages: int, capacity: int, room: RoomId) -> bool:
        """Take ``pages`` of the node's ``capacity`` for ``room``, atomically; False if they are not free.
        A room holds one reservation on a node: taking it again changes nothing."""

    @abc.abstractmethod
    async def release(self, node_id: str, pages: int, room: RoomId) -> None: ...

    @abc.abstractmethod
    async def load(self, node_id: str) -> Load: ...

    @abc.abstractmethod
    async def rooms_on(self, node_id: str) -> set[RoomId]:
        """Rooms in flight placed on the node."""

    # -- rooms ------------------------------------------------------------------------

    @abc.abstractmethod
    async def create_room(self, room: RoomData) -> bool:
        """Store a new room; False if its id is taken."""

    @abc.abstractmethod
    async def room(self, room_id: RoomId) -> RoomData | None: ...

    @abc.abstractmethod
    async def update_room(self, room_id: RoomId, change: Change) -> RoomData | None:
        """Apply ``change`` atomically (a finished room is kept for a while, then forgotten).

        ``change`` returns whether it changed the room; one that returns False must leave it as
        it was: a store may hand it the stored room itself."""

    @abc.abstractmethod
    async def link_transfer(self, transfer: TransferId, room_id: RoomId) -> None:
        """Remember which room an attempt's transfer id belongs to."""

    @abc.abstractmethod
    async def room_of(self, transfer: TransferId) -> RoomId | None: ...

    @abc.abstractmethod
    async def recent(self, limit: int) -> list[RoomData]:
        """The newest rooms first."""

    @abc.abstractmethod
    async def in_flight(self) -> list[RoomId]: ...

    @abc.abstractmethod
    async def add_tokens(self, room_id: RoomId, offset: int, tokens: list[int]) -> bool:
        """Streamed tokens, in order; a chunk that repeats or skips ahead is refused."""

    @abc.abstractmethod
    async def tokens(self, room_id: RoomId) -> list[int]: ...

    # -- bootstraps -------------------------------------------------------------------

    @abc.abstractmethod
    async def announce(self, me: BootstrapInfo, lease_s: float) -> None: ...

    @abc.abstractmethod
    async def bootstraps(self) -> list[BootstrapInfo]: ...

    @abc.abstractmethod
    async def epoch(self, renew: bool = False) -> str:
        """An id that changes when reports may have been lost (``renew``): nodes report every room again."""

    @abc.abstractmethod
    async def params_key(self) -> bytes:
        """The cluster's key for transfer parameters (``shared.wire.grants``): made by the first
        bootstrap of the store, the same for every bootstrap that shares it."""

    async def ping(self) -> None:
        """Raise StoreUnavailable unless the store answers."""

    async def start(self) -> None:
        """Connect and start hearing of changes."""

    async def close(self) -> None: ...


class MemoryStore(Store):
    """This process's own dicts: the embedded default. Finished rooms past ``history`` are forgotten."""

    def __init__(self, history: int, events: RoomEvents):
        super().__init__(events)
        self._history = history
        self._nodes: dict[str, NodeData] = {}
        self._leases: dict[str, float] = {}  # node -> monotonic deadline
        self._loads: dict[str, Load] = {}
        self._placed: dict[str, set[RoomId]] = collections.defaultdict(set)
        self._rooms: collections.OrderedDict[RoomId, RoomData] = collections.OrderedDict()
        self._transfers: dict[TransferId, RoomId] = {}
        self._tokens: dict[RoomId, list[int]] = {}
        self._bootstraps: dict[str, BootstrapInfo] = {}
        self._bootstrap_leases: dict[str, float] = {}  # id -> when its announcement runs out
        self._epoch = secrets.token_hex(8)  # a restart is a new store: its first heartbeat says so
        self._params_key = secrets.token_bytes(grants.KEY_BYTES)

    async def put_node(self, node: NodeData, lease_s: float) -> None:
        self._nodes[node.node_id] = node
        self._leases[node.node_id] = time.monotonic() + lease_s

    async def node(self, node_id: str) -> NodeData | None:
        return self._nodes.get(node_id)

    async def nodes(self) -> list[NodeData]:
        return list(self._nodes.values())

    async def update_node(
        self, node_id: str, change: Callable[[NodeData], None], lease_s: float | None = None
    ) -> NodeData | None:
        node = self._nodes.get(node_id)
        if node is not None:
            change(node)
            if lease_s is not None:
                self._leases[node_id] = time.monotonic() + lease_s
        return node

    async def alive(self, node_id: str) -> bool:
        return self._leases.get(node_id, 0.0) > time.monotonic()

    async def remove_node(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)
        self._leases.pop(node_id, None)

    async def reserve(self, node_id: str, pages: int, capacity: int, room: RoomId) -> bool:
        load = self._loads.setdefault(node_id, Load())
        if room in self._placed[node_id]:
            return True
        if load.pages + pages > capacity:
            return False
        load.pages += pages
        load.rooms += 1
        self._placed[node_id].add(room)
        return True

    async def release(self, node_id: str, pages: int, room: RoomId) -> None:
        if room not in self._placed[node_id]:
            return
        self._placed[node_id].discard(room)
        load = self._loads[node_id]
        load.pages -= pages
        load.rooms -= 1

    async def load(self, node_id: str) -> Load:
        return self._loads.get(node_id, Load())

    async def rooms_on(self, node_id: str) -> set[RoomId]:
        return set(self._placed.get(node_id, ()))

    async def create_room(self, room: RoomData) -> bool:
        if room.room in self._rooms:
            return False
        self._rooms[room.room] = room
        self._trim()
        return True

    def _trim(self) -> None:
        """Forget the oldest finished rooms past the history size; O(1) per room added.

        A room still in flight at the head holds trimming back until it finishes.
        """
        while len(self._rooms) > self._history:
            oldest = next(iter(self._rooms.values()))
            if not oldest.done:
                return
            self._rooms.popitem(last=False)
            self._tokens.pop(oldest.room, None)
            for attempt in oldest.attempts:
                self._transfers.pop(attempt.transfer, None)

    async def room(self, room_id: RoomId) -> RoomData | None:
        return self._rooms.get(room_id)

    async def update_room(self, room_id: RoomId, change: Change) -> RoomData | None:
        room = self._rooms.get(room_id)
        if room is None:
            return None
        if change(room):
            if room.done:
                self._trim()
            self.events.changed(room_id)
        return room

    async def link_transfer(self, transfer: TransferId, room_id: RoomId) -> None:
        self._transfers[transfer] = room_id

    async def room_of(self, transfer: TransferId) -> RoomId | None:
        return self._transfers.get(transfer)

    async def recent(self, limit: int) -> list[RoomData]:
        out = []
        for room in reversed(self._rooms.values()):
            out.append(room)
            if len(out) == limit:
                break
        return out

    async def in_flight(self) -> list[RoomId]:
        return [r.room for r in self._rooms.values() if not r.done]

    async def add_tokens(self, room_id: RoomId, offset: int, tokens: list[int]) -> bool:
        have = self._tokens.setdefault(room_id, [])
        if offset != len(have):
            return False
        have += tokens
        self.events.changed(room_id)
        return True

    async def tokens(self, room_id: RoomId) -> list[int]:
        return list(self._tokens.get(room_id, ()))

    async def announce(self, me: BootstrapInfo, lease_s: float) -> None:
        me.seen = time.time()
        self._bootstraps[me.id] = me
        self._bootstrap_leases[me.id] = time.monotonic() + lease_s

    async def bootstraps(self) -> list[BootstrapInfo]:
        now = time.monotonic()
        return [b for b in self._bootstraps.values() if self._bootstrap_leases[b.id] > now]

    async def epoch(self, renew: bool = False) -> str:
        if renew:
            self._epoch = secrets.token_hex(8)
        return self._epoch

    async def params_key(self) -> bytes:
        return self._params_key


def open_store(url: str, history: int, room_ttl_s: float, events: RoomEvents) -> Store:
    if url == "memory":
        return MemoryStore(history, events)
    from bootstrap.redis_store import RedisStore

    return RedisStore(url, history, room_ttl_s, events)
