"""The ``Store`` contract, held to both stores: every test runs on ``MemoryStore`` and on ``RedisStore``
(a real redis-server), and checks what the interface's docstrings state, not how either keeps it.
"""

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from bootstrap.store import Attempt, BootstrapInfo, Load, NodeData, RoomData, Store, open_store
from tests.support import until_async

HISTORY = 50
ROOM_TTL_S = 60.0
SHORT_LEASE_S = 0.1
LONG_LEASE_S = 60.0


class Heard:
    """The store's ``RoomEvents``: the rooms it said changed, and every resync."""

    def __init__(self) -> None:
        self.rooms: list[int] = []
        self.resyncs = 0

    def changed(self, room: int) -> None:
        self.rooms.append(room)

    def resync(self) -> None:
        self.resyncs += 1


Body = Callable[[Store, Heard], Awaitable[None]]
Contract = Callable[..., None]


@pytest.fixture(params=["memory", "redis"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def contract(kind: str, request: pytest.FixtureRequest) -> Contract:
    """Run an async body against a started store of ``kind``, closed afterwards whatever happens."""
    url = "memory" if kind == "memory" else request.getfixturevalue("redis").url

    def run(body: Body, history: int = HISTORY, room_ttl_s: float = ROOM_TTL_S) -> None:
        async def main() -> None:
            heard = Heard()
            store = open_store(url, history, room_ttl_s, heard)
            await store.start()
            try:
                if kind == "redis":  # changes are heard once the event channel is subscribed
                    await until_async(lambda: heard.resyncs, 10, "the event channel")
                await body(store, heard)
            finally:
                await store.close()

        asyncio.run(main())

    return run


async def eventually(check: Callable[[], Awaitable[object]], what: str, timeout: float = 5.0) -> None:
    """Ask the store ``check`` again and again until it answers true; TimeoutError after ``timeout``."""
    probe = asyncio.ensure_future(check())

    def answered() -> bool:
        nonlocal probe
        if not probe.done():
            return False
        if probe.result():
            return True
        probe = asyncio.ensure_future(check())
        return False

    try:
        await until_async(answered, timeout, what)
    finally:
        probe.cancel()


def a_node(node_id: str, registration: bytes = b'{"role": "decode"}') -> NodeData:
    return NodeData(node_id=node_id, registration=registration, registered_at=1.0, last_seen=2.0)


def a_room(room_id: int, created: float | None = None, max_new_tokens: int = 4) -> RoomData:
    return RoomData(
        room=room_id,
        input_ids=[1, 2, 3],
        max_new_tokens=max_new_tokens,
        stop=["\n"],
        stream=True,
        created=1000.0 + room_id if created is None else created,
        attempts=[Attempt(transfer=100 + room_id, prefill="prefill-0", decode="decode-0")],
    )


def finish(room: RoomData) -> bool:
    room.done, room.outcome = True, "success"
    return True


# -- nodes ----------------------------------------------------------------------------


def test_a_node_put_is_read_back_and_put_again_replaces_it(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.node("decode-0") is None
        assert await store.nodes() == []
        await store.put_node(a_node("decode-0"), LONG_LEASE_S)
        await store.put_node(a_node("prefill-0", b'{"role": "prefill"}'), LONG_LEASE_S)
        assert await store.node("decode-0") == a_node("decode-0")
        assert sorted(n.node_id for n in await store.nodes()) == ["decode-0", "prefill-0"]

        await store.put_node(a_node("decode-0", b'{"role": "decode", "num_pages": 8}'), LONG_LEASE_S)
        again = await store.node("decode-0")
        assert again is not None and again.registration == b'{"role": "decode", "num_pages": 8}'
        assert sorted(n.node_id for n in await store.nodes()) == ["decode-0", "prefill-0"]

    contract(body)


def test_update_node_changes_the_node_and_none_for_an_unknown_one(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        def unhealthy(node: NodeData) -> None:
            node.healthy, node.problem = False, "disk"

        assert await store.update_node("nobody", unhealthy) is None
        assert await store.node("nobody") is None
        assert await store.nodes() == []

        await store.put_node(a_node("decode-0"), LONG_LEASE_S)
        changed = await store.update_node("decode-0", unhealthy)
        assert changed is not None and (changed.healthy, changed.problem) == (False, "disk")
        stored = await store.node("decode-0")
        assert stored is not None and (stored.healthy, stored.problem) == (False, "disk")

    contract(body)


def test_update_node_is_atomic(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.put_node(a_node("decode-0"), LONG_LEASE_S)

        def seen_once_more(node: NodeData) -> None:
            node.last_seen += 1

        await asyncio.gather(*(store.update_node("decode-0", seen_once_more) for _ in range(20)))
        stored = await store.node("decode-0")
        assert stored is not None and stored.last_seen == 2.0 + 20

    contract(body)


def test_a_lease_runs_out_unless_renewed_and_the_node_stays_registered(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert not await store.alive("nobody")
        await store.put_node(a_node("steady"), LONG_LEASE_S)
        await store.put_node(a_node("quiet"), SHORT_LEASE_S)
        assert await store.alive("steady")

        async def quiet_dead() -> bool:
            return not await store.alive("quiet")

        await eventually(quiet_dead, "the short lease to run out")
        assert await store.alive("steady")
        assert await store.node("quiet") == a_node("quiet")  # the lease ran out, not the registration

        await store.update_node("quiet", lambda n: None)  # a change without a lease renews nothing
        assert not await store.alive("quiet")
        renewed = await store.update_node("quiet", lambda n: None, lease_s=LONG_LEASE_S)
        assert renewed is not None and await store.alive("quiet")

    contract(body)


def test_putting_a_node_again_renews_its_lease(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.put_node(a_node("decode-0"), SHORT_LEASE_S)

        async def dead() -> bool:
            return not await store.alive("decode-0")

        await eventually(dead, "the short lease to run out")
        await store.put_node(a_node("decode-0"), LONG_LEASE_S)
        assert await store.alive("decode-0")

    contract(body)


def test_a_removed_node_is_gone(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.put_node(a_node("decode-0"), LONG_LEASE_S)
        await store.put_node(a_node("decode-1"), LONG_LEASE_S)
        await store.remove_node("decode-0")
        await store.remove_node("never-registered")
        assert await store.node("decode-0") is None
        assert not await store.alive("decode-0")
        assert [n.node_id for n in await store.nodes()] == ["decode-1"]
        assert await store.alive("decode-1")

    contract(body)


# -- capacity -------------------------------------------------------------------------


def test_reserve_takes_pages_up_to_the_capacity_and_no_further(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.load("decode-0") == Load(0, 0)
        assert await store.rooms_on("decode-0") == set()

        assert await store.reserve("decode-0", 3, 5, room=1)
        assert not await store.reserve("decode-0", 3, 5, room=2)  # 6 > 5: refused, nothing taken
        assert await store.load("decode-0") == Load(pages=3, rooms=1)
        assert await store.rooms_on("decode-0") == {1}

        assert await store.reserve("decode-0", 2, 5, room=2)  # exactly the capacity
        assert await store.load("decode-0") == Load(pages=5, rooms=2)
        assert await store.rooms_on("decode-0") == {1, 2}
        assert not await store.reserve("decode-0", 1, 5, room=3)

        assert await store.reserve("decode-1", 5, 5, room=3)  # the capacity is each node's own
        assert await store.load("decode-1") == Load(pages=5, rooms=1)
        assert await store.rooms_on("decode-1") == {3}
        assert await store.rooms_on("decode-0") == {1, 2}

    contract(body)


def test_release_gives_back_only_the_pages_the_room_took(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.reserve("decode-0", 3, 5, room=1)
        assert await store.reserve("decode-0", 2, 5, room=2)

        await store.release("decode-0", 3, room=9)  # room 9 holds nothing here
        await store.release("decode-1", 2, room=2)  # nor does room 2 on another node
        assert await store.load("decode-0") == Load(pages=5, rooms=2)
        assert await store.load("decode-1") == Load(0, 0)

        await store.release("decode-0", 3, room=1)
        assert await store.load("decode-0") == Load(pages=2, rooms=1)
        assert await store.rooms_on("decode-0") == {2}
        await store.release("decode-0", 3, room=1)  # released twice: given back once
        assert await store.load("decode-0") == Load(pages=2, rooms=1)

        assert await store.reserve("decode-0", 3, 5, room=3)  # the pages are free again

    contract(body)


def test_concurrent_reservations_never_pass_the_capacity(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        taken = await asyncio.gather(*(store.reserve("decode-0", 1, 4, room=r) for r in range(12)))
        assert taken.count(True) == 4
        assert await store.load("decode-0") == Load(pages=4, rooms=4)
        assert await store.rooms_on("decode-0") == {r for r, ok in enumerate(taken) if ok}

    contract(body)


def test_a_room_holds_one_reservation_on_a_node(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.reserve("decode-0", 2, 10, room=1)
        assert await store.reserve("decode-0", 2, 10, room=1)
        assert await store.load("decode-0") == Load(pages=2, rooms=1)
        await store.release("decode-0", 2, room=1)
        assert await store.load("decode-0") == Load(0, 0)
        assert await store.rooms_on("decode-0") == set()

    contract(body)


# -- rooms ----------------------------------------------------------------------------


def test_create_room_refuses_a_taken_id_and_keeps_the_first(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.room(1) is None
        assert await store.create_room(a_room(1, max_new_tokens=4))
        assert not await store.create_room(a_room(1, max_new_tokens=9))
        assert await store.room(1) == a_room(1, max_new_tokens=4)
        assert [r.room for r in await store.recent(10)] == [1]

    contract(body)


def test_update_room_writes_the_change_and_none_for_an_unknown_room(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.update_room(7, finish) is None
        assert await store.room(7) is None

        await store.create_room(a_room(1))
        updated = await store.update_room(1, finish)
        assert updated is not None and (updated.done, updated.outcome) == (True, "success")
        stored = await store.room(1)
        assert stored is not None and (stored.done, stored.outcome) == (True, "success")

    contract(body)


def test_update_room_is_atomic(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.create_room(a_room(1))

        def resent(room: RoomData) -> bool:
            room.attempt.resent += 1
            return True

        await asyncio.gather(*(store.update_room(1, resent) for _ in range(20)))
        stored = await store.room(1)
        assert stored is not None and stored.attempt.resent == 20

    contract(body)


def test_a_room_change_is_heard_with_the_room_id(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.create_room(a_room(1))
        await store.create_room(a_room(2))
        await store.update_room(2, finish)
        await until_async(lambda: heard.rooms == [2], 5, "room 2's change")
        assert await store.add_tokens(1, 0, [5])
        await until_async(lambda: heard.rooms == [2, 1], 5, "room 1's tokens")

    contract(body)


def test_a_change_that_changed_nothing_is_not_heard(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.create_room(a_room(1))
        await store.create_room(a_room(2))
        unchanged = await store.update_room(1, lambda room: False)
        assert unchanged is not None and unchanged.room == 1
        await store.update_room(2, finish)  # heard after anything said of room 1 before it
        await until_async(lambda: 2 in heard.rooms, 5, "room 2's change")
        assert heard.rooms == [2]

    contract(body)


def test_a_transfer_leads_to_its_room(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.room_of(101) is None
        await store.create_room(a_room(1))
        await store.link_transfer(101, 1)
        await store.link_transfer(202, 1)  # the room placed again: a second attempt
        await store.link_transfer(303, 3)
        assert (await store.room_of(101), await store.room_of(202), await store.room_of(303)) == (1, 1, 3)
        assert await store.room_of(404) is None

    contract(body)


def test_recent_is_the_newest_rooms_first_up_to_the_limit(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.recent(3) == []
        for room_id in (1, 2, 3, 4):
            await store.create_room(a_room(room_id))
        await store.update_room(2, finish)
        assert [r.room for r in await store.recent(2)] == [4, 3]
        newest = await store.recent(10)
        assert [r.room for r in newest] == [4, 3, 2, 1]
        assert newest[2].done  # the rooms as they are now, not as they were created

    contract(body)


def test_in_flight_is_every_room_not_done(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.in_flight() == []
        for room_id in (1, 2, 3):
            await store.create_room(a_room(room_id))
        await store.update_room(2, finish)
        assert sorted(await store.in_flight()) == [1, 3]

    contract(body)


def test_in_flight_lists_a_room_however_many_came_after_it(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        for room_id in (1, 2, 3, 4):
            await store.create_room(a_room(room_id))
        await store.update_room(4, finish)
        assert sorted(await store.in_flight()) == [1, 2, 3]

    contract(body, history=2)


def test_a_finished_room_is_forgotten_in_time_a_room_in_flight_never(contract: Contract) -> None:
    """Forgotten with it: its tokens and which room its transfers led to."""

    async def body(store: Store, heard: Heard) -> None:
        for room_id in (1, 2):
            await store.create_room(a_room(room_id))
            await store.link_transfer(100 + room_id, room_id)
            assert await store.add_tokens(room_id, 0, [7, 8])
        await store.update_room(1, finish)
        for room_id in (3, 4):  # more rooms than the history holds, finished
            await store.create_room(a_room(room_id))
            await store.update_room(room_id, finish)

        async def forgotten() -> bool:
            return (
                await store.room(1) is None
                and await store.tokens(1) == []
                and await store.room_of(101) is None
                and 1 not in [r.room for r in await store.recent(10)]
            )

        await eventually(forgotten, "the finished room 1 to be forgotten")
        assert await store.room(2) == a_room(2)
        assert await store.tokens(2) == [7, 8]
        assert await store.room_of(102) == 2

    contract(body, history=2, room_ttl_s=0.2)


# -- tokens ---------------------------------------------------------------------------


def test_tokens_are_taken_in_order_and_a_repeat_or_a_gap_is_refused(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.tokens(1) == []
        assert not await store.add_tokens(1, 2, [9])  # ahead of nothing
        assert await store.add_tokens(1, 0, [10, 11])
        assert await store.add_tokens(1, 2, [12])
        assert not await store.add_tokens(1, 0, [10, 11])  # the first chunk again
        assert not await store.add_tokens(1, 2, [12])  # the last chunk again
        assert not await store.add_tokens(1, 1, [11, 12])  # overlapping
        assert not await store.add_tokens(1, 4, [14])  # skipping offset 3
        assert await store.tokens(1) == [10, 11, 12]
        assert await store.add_tokens(1, 3, [13])
        assert await store.tokens(1) == [10, 11, 12, 13]
        assert await store.tokens(2) == []  # each room its own

    contract(body)


def test_two_chunks_at_one_offset_only_one_is_taken(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        taken = await asyncio.gather(*(store.add_tokens(1, 0, [t]) for t in range(8)))
        assert taken.count(True) == 1
        assert await store.tokens(1) == [taken.index(True)]

    contract(body)


# -- bootstraps and the epoch ---------------------------------------------------------


def test_announced_bootstraps_are_listed_once_each(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        assert await store.bootstraps() == []
        await store.announce(BootstrapInfo("a", "tcp://127.0.0.1:1", "key-a"), LONG_LEASE_S)
        await store.announce(BootstrapInfo("b", "tcp://127.0.0.1:2", "key-b"), LONG_LEASE_S)
        await store.announce(BootstrapInfo("a", "tcp://127.0.0.1:3", "key-a"), LONG_LEASE_S)
        listed = {b.id: b.report_endpoint for b in await store.bootstraps()}
        assert listed == {"a": "tcp://127.0.0.1:3", "b": "tcp://127.0.0.1:2"}

    contract(body)


def test_a_bootstrap_whose_lease_ran_out_is_not_listed(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        await store.announce(BootstrapInfo("steady", "tcp://127.0.0.1:1", "key-s"), LONG_LEASE_S)
        await store.announce(BootstrapInfo("gone", "tcp://127.0.0.1:2", "key-g"), SHORT_LEASE_S)

        async def only_steady() -> bool:
            return [b.id for b in await store.bootstraps()] == ["steady"]

        await eventually(only_steady, "the short lease to run out", timeout=2.0)

    contract(body)


def test_the_epoch_holds_until_renewed(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        first = await store.epoch()
        assert first and await store.epoch() == first
        renewed = await store.epoch(renew=True)
        assert renewed != first
        assert await store.epoch() == renewed
        assert await store.epoch(renew=True) not in (first, renewed)

    contract(body)


def test_the_key_for_transfer_parameters_holds(contract: Contract) -> None:
    async def body(store: Store, heard: Heard) -> None:
        key = await store.params_key()
        assert len(key) == 32 and await store.params_key() == key

    contract(body)


def test_bootstraps_sharing_a_redis_sign_with_one_key(redis):
    async def main() -> None:
        first, second = (open_store(redis.url, 100, 60, Heard()) for _ in range(2))
        for store in (first, second):
            await store.start()
        try:
            keys = await asyncio.gather(first.params_key(), second.params_key())
            assert keys[0] == keys[1] and len(keys[0]) == 32
        finally:
            for store in (first, second):
                await store.close()

    asyncio.run(main())


def test_a_redis_restarted_under_the_store_is_used_again_at_once(redis):
    """Connections pooled before Redis restarted are dead, found so only when used: every command
    after the restart still succeeds (what the bootstrap reads right after its health says so)."""

    async def main() -> None:
        store = open_store(redis.url, 100, 60, Heard())
        await store.start()
        try:
            await asyncio.gather(*(store.create_room(a_room(i)) for i in range(1, 9)))  # several connections
            redis.stop()
            redis.start()  # the same data directory: the rooms are back
            rooms = await asyncio.gather(*(store.room(i) for i in range(1, 9)))
            assert [r.room for r in rooms if r is not None] == list(range(1, 9))
        finally:
            await store.close()

    asyncio.run(main())
