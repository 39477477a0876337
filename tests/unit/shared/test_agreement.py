"""Agreement between a node's ranks: Solo, the Leader's fold, and one message per loop turn."""

import asyncio

from shared.node.agreement import FollowerParticipant, Leader, LeaderParticipant, Solo
from shared.room.states import FailureReason, RoomState
from shared.wire import protocol

S = RoomState
Agreed = tuple[int, RoomState, str | None]


def rs(room: int, state: RoomState, reason: str | None = None, digest: int = 0) -> protocol.RankState:
    return protocol.RankState(room, int(state), reason, digest)


def test_solo_agrees_at_once_with_its_own_state():
    heard: list[Agreed] = []
    solo = Solo(lambda *a: heard.append(a))
    solo.local(5, S.TRANSFERRING, "not a failure")
    assert heard == [(5, S.TRANSFERRING, None)]
    solo.local(5, S.SUCCESS, digest=77)
    solo.local(6, S.FAILED, "aux_timeout")
    assert heard[1:] == [(5, S.SUCCESS, None), (6, S.FAILED, "aux_timeout")]


class Deliveries:
    """What a leader hands to the ranks: one list per call."""

    def __init__(self) -> None:
        self.calls: list[list[protocol.RankState]] = []

    def __call__(self, states: list[protocol.RankState]) -> None:
        self.calls.append(states)


def test_leader_of_two_agrees_on_the_minimum_and_tells_each_change_once():
    out = Deliveries()
    leader = Leader(2, out)
    leader.contribute(0, [rs(5, S.TRANSFERRING)])
    assert out.calls == [[rs(5, S.BOOTSTRAPPING)]]  # rank 1 not heard from yet
    leader.contribute(1, [rs(5, S.WAITING_FOR_INPUT)])
    assert out.calls[-1] == [rs(5, S.WAITING_FOR_INPUT)]
    leader.contribute(1, [rs(5, S.WAITING_FOR_INPUT)])  # nothing new
    leader.contribute(0, [rs(5, S.SUCCESS, digest=9)])  # the minimum is still rank 1's
    assert len(out.calls) == 2
    leader.contribute(1, [rs(5, S.TRANSFERRING)])
    leader.contribute(1, [rs(5, S.SUCCESS, digest=9)])
    assert out.calls[2:] == [[rs(5, S.TRANSFERRING)], [rs(5, S.SUCCESS)]]
    assert leader.rooms() == 0  # ended: forgotten


def test_a_room_that_ended_ignores_later_words():
    out = Deliveries()
    leader = Leader(2, out)
    leader.contribute(0, [rs(5, S.FAILED, "aborted")])
    assert out.calls == [[rs(5, S.FAILED, "aborted")]]  # at once, without waiting for rank 1
    assert leader.rooms() == 0
    leader.contribute(1, [rs(5, S.TRANSFERRING)])
    leader.contribute(1, [rs(5, S.SUCCESS, digest=1)])
    leader.contribute(0, [rs(5, S.FAILED, "again")])
    assert out.calls == [[rs(5, S.FAILED, "aborted")]]
    assert leader.rooms() == 0


def test_leader_of_four_waits_for_every_rank():
    out = Deliveries()
    leader = Leader(4, out)
    for rank in (3, 0, 2):
        leader.contribute(rank, [rs(8, S.SUCCESS, digest=4)])
    assert out.calls == [[rs(8, S.BOOTSTRAPPING)]]
    assert leader.rooms() == 1
    leader.contribute(1, [rs(8, S.TRANSFERRING)])
    leader.contribute(1, [rs(8, S.SUCCESS, digest=4)])
    assert out.calls[1:] == [[rs(8, S.TRANSFERRING)], [rs(8, S.SUCCESS)]]
    assert leader.rooms() == 0


def test_ready_ranks_with_different_records_agree_on_failure():
    out = Deliveries()
    leader = Leader(4, out)
    for rank in range(4):
        leader.contribute(rank, [rs(8, S.SUCCESS, digest=4 if rank != 2 else 5)])
    assert out.calls[-1] == [rs(8, S.FAILED, FailureReason.AUX_MISMATCH)]
    assert S.SUCCESS not in {RoomState(s.state) for call in out.calls for s in call}


def test_one_contribution_of_many_rooms_is_one_delivery_in_order():
    out = Deliveries()
    leader = Leader(2, out)
    leader.contribute(1, [rs(r, S.TRANSFERRING) for r in (3, 1, 2)])
    leader.contribute(0, [rs(3, S.TRANSFERRING), rs(1, S.FAILED, "shutdown"), rs(2, S.WAITING_FOR_INPUT)])
    assert out.calls == [
        [rs(3, S.BOOTSTRAPPING), rs(1, S.BOOTSTRAPPING), rs(2, S.BOOTSTRAPPING)],
        [rs(3, S.TRANSFERRING), rs(1, S.FAILED, "shutdown"), rs(2, S.WAITING_FOR_INPUT)],
    ]
    assert leader.rooms() == 2


async def next_turn() -> None:
    """Return once every callback the loop had scheduled so far has run."""
    done = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_soon(done.set_result, None)
    await done


def test_a_follower_sends_one_turns_changes_as_one_message():
    async def run() -> list[protocol.Message]:
        sent: list[protocol.Message] = []
        follower = FollowerParticipant(asyncio.get_running_loop(), 2, sent.append, lambda *a: None)
        for room in range(1, 51):
            follower.local(room, S.TRANSFERRING)
        follower.local(7, S.FAILED, "aux_invalid")  # a later change of a room in the same turn wins
        assert sent == []  # nothing before the turn ends
        await next_turn()
        assert len(sent) == 1
        follower.local(60, S.SUCCESS, digest=12)
        await next_turn()
        await next_turn()  # no further turn sends anything on its own
        return sent

    sent = asyncio.run(run())
    first = [rs(r, S.TRANSFERRING) if r != 7 else rs(7, S.FAILED, "aux_invalid") for r in range(1, 51)]
    assert sent == [protocol.RankStates(2, first), protocol.RankStates(2, [rs(60, S.SUCCESS, digest=12)])]


def test_the_leaders_own_rank_contributes_once_per_turn():
    async def run() -> tuple[list[tuple[int, int]], list[protocol.Message], list[Agreed]]:
        sent: list[protocol.Message] = []
        heard: list[Agreed] = []
        me = LeaderParticipant(asyncio.get_running_loop(), 1, sent.append, lambda *a: heard.append(a))
        contributions: list[tuple[int, int]] = []  # (rank, rooms in it)
        real = me.leader.contribute

        def counted(rank: int, states: list[protocol.RankState]) -> None:
            contributions.append((rank, len(states)))
            real(rank, states)

        me.leader.contribute = counted  # type: ignore[method-assign]
        for room in range(1, 51):
            me.local(room, S.WAITING_FOR_INPUT)
        assert contributions == []
        await next_turn()
        return contributions, sent, heard

    contributions, sent, heard = asyncio.run(run())
    assert contributions == [(0, 50)]
    # The agreed changes go to the other ranks in one message and to this rank at once.
    assert sent == [protocol.RankAgreed([rs(r, S.WAITING_FOR_INPUT) for r in range(1, 51)])]
    assert heard == [(r, S.WAITING_FOR_INPUT, None) for r in range(1, 51)]


def test_a_node_of_two_ranks_agrees_through_the_leader():
    """Rank 0 holds the leader, rank 1 reaches it through a link; both hear the same agreed changes."""

    async def run() -> tuple[list[Agreed], list[Agreed], list[protocol.Message]]:
        loop = asyncio.get_running_loop()
        heard0: list[Agreed] = []
        heard1: list[Agreed] = []
        link: list[protocol.Message] = []
        ranks: list[LeaderParticipant | FollowerParticipant] = []

        def broadcast(msg: protocol.Message) -> None:
            assert isinstance(msg, protocol.RankAgreed)
            ranks[1].agreed(msg.states)

        def to_leader(msg: protocol.Message) -> None:
            assert isinstance(msg, protocol.RankStates)
            link.append(msg)
            ranks[0].contribute(msg.rank, msg.states)

        ranks[:] = [
            LeaderParticipant(loop, 2, broadcast, lambda *a: heard0.append(a)),
            FollowerParticipant(loop, 1, to_leader, lambda *a: heard1.append(a)),
        ]
        for rank in ranks:
            rank.local(4, S.TRANSFERRING)
            rank.local(5, S.TRANSFERRING)
        await next_turn()
        ranks[0].local(4, S.SUCCESS, digest=3)
        ranks[1].local(4, S.SUCCESS, digest=3)
        ranks[1].local(5, S.FAILED, "kv_corrupt")
        await next_turn()
        return heard0, heard1, link

    heard0, heard1, link = asyncio.run(run())
    assert (
        heard0
        == heard1
        == [
            (4, S.BOOTSTRAPPING, None),
            (5, S.BOOTSTRAPPING, None),
            (4, S.TRANSFERRING, None),
            (5, S.TRANSFERRING, None),
            (4, S.SUCCESS, None),
            (5, S.FAILED, "kv_corrupt"),
        ]
    )
    assert len(link) == 2  # one message from rank 1 per turn
