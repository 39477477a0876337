"""The store in Redis: bootstraps may restart, or run side by side, and lose nothing Redis kept.

Keys (all under ``kvroom:``):

- ``node:{id}`` a node's record; ``nodes`` the set of node ids; ``lease:{id}`` a key
  that expires (PX) unless the node heartbeats: it is alive while the key exists;
- ``load:{id}`` a hash of the pages and rooms placed on the node, changed only by
  the Lua scripts below, so two bootstraps never both take the last pages;
  ``placed:{id}`` the set of its rooms in flight;
- ``room:{id}`` a room's record, changed by optimistic transactions (WATCH, MULTI)
  and given an expiry once it finished (``room_ttl_s``); ``tokens:{id}`` its
  streamed tokens; ``transfer:{id}`` the room of an attempt; ``rooms`` a sorted
  set of room ids by creation, trimmed to the history size;
- ``bootstrap:{id}`` each live bootstrap, with a lease;
- channel ``events``: the id of every room that changed, so each bootstrap wakes
  its own waiters.

Redis going away makes every call raise StoreUnavailable: the bootstrap reports
unhealthy and refuses new rooms with 503 until it is back.
"""

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError

from bootstrap.store import (
    BootstrapInfo,
    Change,
    Load,
    NodeData,
    RoomData,
    RoomEvents,
    Store,
    StoreUnavailable,
)
from shared.room.record import TransferId
from shared.wire import grants
from shared.wire.protocol import RoomId

log = logging.getLogger(__name__)
P = "kvroom:"
_rooms_encoder = msgspec.msgpack.Encoder()
_room = msgspec.msgpack.Decoder(RoomData)
_node = msgspec.msgpack.Decoder(NodeData)
_bootstrap = msgspec.msgpack.Decoder(BootstrapInfo)

# Take pages of a node atomically: KEYS load, placed; ARGV pages, capacity, room.
_RESERVE = """
local used = tonumber(redis.call('HGET', KEYS[1], 'pages') or '0')
if used + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return 0 end
if redis.call('SADD', KEYS[2], ARGV[3]) == 0 then return 1 end
redis.call('HINCRBY', KEYS[1], 'pages', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'rooms', 1)
return 1
"""
_RELEASE = """
if redis.call('SREM', KEYS[2], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'pages', -tonumber(ARGV[1]))
redis.call('HINCRBY', KEYS[1], 'rooms', -1)
return 1
"""


class RedisStore(Store):
    def __init__(self, url: str, history: int, room_ttl_s: float, events: RoomEvents):
        super().__init__(events)
        self._url = url
        self._history = history
        self._room_ttl_ms = int(room_ttl_s * 1000)
        self._params_key: bytes | None = None
        # A pooled connection that Redis closed while it was away is found dead on its next use:
        # that command is tried once more, on the connection made again.
        self._redis: aioredis.Redis = aioredis.from_url(
            url,
            socket_timeout=2.0,
            socket_connect_timeout=2.0,
            retry=Retry(NoBackoff(), 1),
            retry_on_error=[RedisConnectionError],
        )
        # The event channel's own client, without that retry: a lost subscription must be seen, since
        # what changed while it was down was heard by no one (``RoomEvents.resync``).
        self._channel: aioredis.Redis = aioredis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._reserve = self._redis.register_script(_RESERVE)
        self._release = self._redis.register_script(_RELEASE)
        self._listener: asyncio.Task[None] | None = None

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except (RedisError, OSError) as exc:
            raise StoreUnavailable(f"redis at {self._url}: {exc}") from exc

    async def ping(self) -> None:
        await self._call(self._redis.ping)

    async def start(self) -> None:
        self._listener = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        """Hear of every room any bootstrap changed; reconnect when Redis comes back."""
        me = asyncio.current_task()
        while True:
            try:
                async with self._channel.pubsub() as pubsub:
                    await pubsub.subscribe(P + "events")
                    self.events.resync()  # what changed before the subscription was heard by no one
                    async for message in pubsub.listen():
                        if message["type"] == "message":
                            self.events.changed(RoomId(int(message["data"])))
            except (RedisError, OSError) as exc:
                # The client can turn a cancel that lands mid-reconnect into a connection error:
                # a cancelled listener must stop, or close() waits on it for ever.
                if me is not None and me.cancelling():
                    raise asyncio.CancelledError from exc
                log.warning("lost the redis event channel (%s); retrying", exc)
                await asyncio.sleep(0.5)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        for client in (self._redis, self._channel):
            with contextlib.suppress(RedisError, OSError):
                await client.aclose()

    # -- nodes ------------------------------------------------------------------------

    async def put_node(self, node: NodeData, lease_s: float) -> None:
        async def put() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(P + f"node:{node.node_id}", _rooms_encoder.encode(node))
                pipe.sadd(P + "nodes", node.node_id)
                pipe.set(P + f"lease:{node.node_id}", b"1", px=int(lease_s * 1000))
                await pipe.execute()

        await self._call(put)

    async def node(self, node_id: str) -> NodeData | None:
        raw = await self._call(self._redis.get, P + f"node:{node_id}")
        return _node.decode(raw) if raw else None

    async def nodes(self) -> list[NodeData]:
        ids = sorted(await self._call(self._redis.smembers, P + "nodes"))
        if not ids:
            return []
        raws = await self._call(self._redis.mget, [P + f"node:{i.decode()}" for i in ids])
        return [_node.decode(raw) for raw in raws if raw]

    async def _transact(
        self,
        key: str,
        decoder: msgspec.msgpack.Decoder[Any],
        change: Callable[[Any], bool],
        queue: Callable[[Any, Any], None],
    ) -> Any:
        """Read ``key``, ``change`` the record, and write it back with ``queue``'s commands in one
        optimistic transaction (WATCH, MULTI), again if another writer came first. None if absent;
        nothing written when ``change`` says nothing changed."""

        async def attempt() -> Any:
            async with self._redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        raw = await pipe.get(key)
                        if not raw:
                            await pipe.reset()
                            return None
                        record = decoder.decode(raw)  # type: ignore[arg-type]
                        if not change(record):
                            await pipe.reset()
                            return record
                        pipe.multi()
                        queue(pipe, record)
                        await pipe.execute()
                        return record
                    except WatchError:
                        continue

        return await self._call(attempt)

    async def update_node(
        self, node_id: str, change: Callable[[NodeData], None], lease_s: float | None = None
    ) -> NodeData | None:
        key = P + f"node:{node_id}"

        def queue(pipe: Any, node: NodeData) -> None:
            pipe.set(key, _rooms_encoder.encode(node))
            if lease_s is not None:
                pipe.set(P + f"lease:{node_id}", b"1", px=int(lease_s * 1000))

        def changed(node: NodeData) -> bool:
            change(node)
            return True

        result: NodeData | None = await self._transact(key, _node, changed, queue)
        return result

    async def alive(self, node_id: str) -> bool:
        return bool(await self._call(self._redis.exists, P + f"lease:{node_id}"))

    async def remove_node(self, node_id: str) -> None:
        async def remove() -> None:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(P + f"node:{node_id}", P + f"lease:{node_id}")
                pipe.srem(P + "nodes", node_id)
                await pipe.execute()

        await self._call(remove)

    async def reserve(self, node_id: str, pages: int, capacity: int, room: RoomId) -> bool:
        keys = [P + f"load:{node_id}", P + f"placed:{node_id}"]
        return bool(await self._call(self._reserve, keys=keys, args=[pages, capacity, room]))

    async def release(self, node_id: str, pages: int, room: RoomId) -> None:
        keys = [P + f"load:{node_id}", P + f"placed:{node_id}"]
        await self._call(self._release, keys=keys, args=[pages, room])

    async def load(self, node_id: str) -> Load:
        raw = await self._call(self._redis.hgetall, P + f"load:{node_id}")
        return Load(int(raw.get(b"pages", 0)), int(raw.get(b"rooms", 0)))

    async def rooms_on(self, node_id: str) -> set[RoomId]:
        return {RoomId(int(r)) for r in await self._call(self._redis.smembers, P + f"placed:{node_id}")}

    # -- rooms ------------------------------------------------------------------------

    async def create_room(self, room: RoomData) -> bool:
        async def create() -> bool:
            if not await self._redis.set(P + f"room:{room.room}", _rooms_encoder.encode(room), nx=True):
                return False
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zadd(P + "rooms", {str(room.room): room.created})
                pipe.zremrangebyrank(P + "rooms", 0, -self._history - 1)
                # Apart from the history, which forgets old rooms whether they ended or not.
                pipe.sadd(P + "in_flight", str(room.room))
                await pipe.execute()
            return True

        created: bool = await self._call(create)
        return created

    async def room(self, room_id: RoomId) -> RoomData | None:
        raw = await self._call(self._redis.get, P + f"room:{room_id}")
        return _room.decode(raw) if raw else None

    async def update_room(self, room_id: RoomId, change: Change) -> RoomData | None:
        key = P + f"room:{room_id}"

        def queue(pipe: Any, room: RoomData) -> None:
            ttl = self._room_ttl_ms if room.done else None
            pipe.set(key, _rooms_encoder.encode(room), px=ttl)
            if room.done:
                pipe.srem(P + "in_flight", str(room_id))
                pipe.pexpire(P + f"tokens:{room_id}", self._room_ttl_ms)
                for attempt in room.attempts:
                    pipe.pexpire(P + f"transfer:{attempt.transfer}", self._room_ttl_ms)
            pipe.publish(P + "events", str(room_id))

        result: RoomData | None = await self._transact(key, _room, change, queue)
        return result

    async def link_transfer(self, transfer: TransferId, room_id: RoomId) -> None:
        await self._call(self._redis.set, P + f"transfer:{transfer}", str(room_id))

    async def room_of(self, transfer: TransferId) -> RoomId | None:
        raw = await self._call(self._redis.get, P + f"transfer:{transfer}")
        return RoomId(int(raw)) if raw else None

    async def recent(self, limit: int) -> list[RoomData]:
        ids = await self._call(self._redis.zrevrange, P + "rooms", 0, limit - 1)
        if not ids:
            return []
        raws = await self._call(self._redis.mget, [P + f"room:{i.decode()}" for i in ids])
        return [_room.decode(raw) for raw in raws if raw]

    async def in_flight(self) -> list[RoomId]:
        return [RoomId(int(r)) for r in await self._call(self._redis.smembers, P + "in_flight")]

    async def add_tokens(self, room_id: RoomId, offset: int, tokens: list[int]) -> bool:
        key = P + f"tokens:{room_id}"

        async def add() -> bool:
            async with self._redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(key)
                        if await pipe.llen(key) != offset:
                            await pipe.reset()
                            return False
                        pipe.multi()
                        pipe.rpush(key, *tokens)
                        pipe.publish(P + "events", str(room_id))
                        await pipe.execute()
                        return True
                    except WatchError:
                        continue

        added: bool = await self._call(add)
        return added

    async def tokens(self, room_id: RoomId) -> list[int]:
        return [int(t) for t in await self._call(self._redis.lrange, P + f"tokens:{room_id}", 0, -1)]

    # -- bootstraps -------------------------------------------------------------------

    async def announce(self, me: BootstrapInfo, lease_s: float) -> None:
        me.seen = time.time()
        await self._call(
            self._redis.set, P + f"bootstrap:{me.id}", _rooms_encoder.encode(me), px=int(lease_s * 1000)
        )

    async def epoch(self, renew: bool = False) -> str:
        key, fresh = P + "epoch", secrets.token_hex(8)
        if renew:
            await self._call(self._redis.set, key, fresh)
            return fresh
        await self._call(self._redis.set, key, fresh, nx=True)  # the first bootstrap of this store
        raw = await self._call(self._redis.get, key)
        return raw.decode() if raw else fresh

    async def params_key(self) -> bytes:
        if self._params_key is None:  # it never changes: read once
            key, fresh = P + "params_key", secrets.token_bytes(grants.KEY_BYTES)
            await self._call(self._redis.set, key, fresh, nx=True)  # the first bootstrap of this store
            raw = await self._call(self._redis.get, key)
            self._params_key = bytes(raw) if raw else fresh
        return self._params_key

    async def bootstraps(self) -> list[BootstrapInfo]:
        async def scan() -> list[bytes]:
            return [k async for k in self._redis.scan_iter(match=P + "bootstrap:*")]

        keys = await self._call(scan)
        if not keys:
            return []
        raws = await self._call(self._redis.mget, keys)
        return [_bootstrap.decode(raw) for raw in raws if raw]
