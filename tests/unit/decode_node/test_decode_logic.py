"""A decode rank's SUCCESS rule, in process, with the fake engine (no transfer is proven here)."""

import asyncio
import time

import pytest
import uvloop

from decode_node.role import DECODE
from decode_node.settings import DecodeSettings
from launcher.local_stack import free_port
from shared.errors import RejectedMessage
from shared.kv import tcp_drain
from shared.kv.aux_buffers import Aux
from shared.kv.lease import LeaseState
from shared.metrics import ServiceMetrics
from shared.models.source import make_source
from shared.node.agreement import Solo
from shared.node.builder import build_service, make_rank
from shared.node.leader import NodeLeader
from shared.node.reports import room_view
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.security import CurveKeys, Security
from tests.support import until_async
from tests.support.fakes import FakeEngine, RecordingLink, RecordingPeers
from tests.support.sockets import loopback_connection

PREFILL_KEY = CurveKeys.generate().public
PREFILL = protocol.PeerRank(0, "prefill:1", "tcp://127.0.0.1:9", PREFILL_KEY, 0, 4)
ROOM = 77


def run(test, **settings):
    """Runs ``test(service, node)`` on uvloop, the loop the nodes run on; ``node`` records what the
    rank reports, ``service.rank.peers`` what it sends its peers."""

    async def main():
        s = DecodeSettings(
            http_port=free_port(),
            zmq_port=free_port(),
            num_pages=32,
            aux_slots=4,
            zmq_security="plain",
            **settings,
        )
        engine = FakeEngine("decode:1", {})
        rank = make_rank(s, 0, make_source(s, 0, None), Security(None), engine, peers=RecordingPeers())
        node = RecordingLink()
        service = build_service(
            DECODE, rank, node, Solo, ServiceMetrics("decode"), asyncio.get_running_loop()
        )
        try:
            await test(service, node)
        finally:
            service.shutdown()
            rank.push.close()
            rank.zmq.term()

    uvloop.run(main())


def assign(service, room=ROOM, prompt_len=20):
    service.handle_assignment(protocol.DecodeRoom(room, prompt_len, 5, "p", [PREFILL]))
    return service.rooms.live[room]


def done(service, room=ROOM, aux_room=ROOM, slot=None, cached=20, aux=True, sender=PREFILL_KEY, pages=2):
    job = service.rooms.find(ROOM)
    msg = protocol.DoneAux(room, 0, 0, job.slots.get(0, 0) if slot is None else slot, pages, 0, 0.0)
    record = Aux(aux_room, 65, cached, -0.5).pack() if aux else None
    service.handle_peer(msg, record, sender)


def accept(service, sender=PREFILL_KEY):
    service.handle_peer(protocol.TransferAccepted(ROOM, 0, 0), None, sender)


def start(service, sender=PREFILL_KEY):
    service.handle_peer(protocol.TransferStarted(ROOM, 0, 0), None, sender)


def test_success_needs_accept_start_done_and_a_valid_aux():
    async def body(service, node):
        job = assign(service)
        assert job.state is RoomState.BOOTSTRAPPING
        assert service.pool.free_pages == 32 - 2 and service.aux.free_slots == 3
        accept(service)
        assert job.state is RoomState.WAITING_FOR_INPUT
        start(service)
        assert job.state is RoomState.TRANSFERRING
        done(service, aux=False)  # the KV is done, the aux is not here
        assert job.state is RoomState.TRANSFERRING
        done(service)
        assert job.state is RoomState.SUCCESS
        assert service.aux.free_slots == 4  # read and zeroed before decoding
        await until_async(lambda: job.outcome is not None)
        assert job.outcome == "completed" and len(job.output_ids) == 5
        assert service.pool.free_pages == 32
        assert node.reports[-1] is RoomState.SUCCESS

    run(body)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"aux_room": ROOM + 1}, "aux_invalid"),
        ({"cached": 3}, "aux_invalid"),
        ({"pages": 1}, "aux_invalid"),
    ],
)
def test_aux_that_is_not_the_rooms_fails_it(kwargs, reason):
    async def body(service, node):
        job = assign(service)
        done(service, **kwargs)
        assert (job.state, job.reason) == (RoomState.FAILED, reason)
        assert service.aux.free_slots == 4
        assert service.pool.free_pages == 32  # the prefill answered for its pages with the done

    run(body)


def test_a_changed_aux_byte_waits_for_an_intact_copy():
    async def body(service, node):
        job = assign(service)
        record = bytearray(Aux(ROOM, 65, 20, -0.5).pack())
        record[8] ^= 1  # the first token, as it would arrive after a bit flip on the way
        service.handle_peer(protocol.DoneAux(ROOM, 0, 0, job.slots[0], 2, 0, 0.0), bytes(record), PREFILL_KEY)
        assert job.state is RoomState.TRANSFERRING and job.aux_missing_since is not None
        assert service.metrics.rejected.labels("aux_corrupt")._value.get() == 1
        done(service)  # the intact copy decides
        assert job.state is RoomState.SUCCESS and job.first_token == 65

    run(body)


def test_messages_from_another_key_or_for_others_slots_are_rejected_without_effect():
    async def body(service, node):
        job = assign(service)
        other = assign(service, room=ROOM + 1)
        with pytest.raises(RejectedMessage, match="another key"):
            done(service, sender=CurveKeys.generate().public)
        with pytest.raises(RejectedMessage, match="another key"):
            accept(service, sender=CurveKeys.generate().public)
        with pytest.raises(RejectedMessage, match="not this room"):
            done(service, slot=other.slots[0])  # someone else's slot
        with pytest.raises(RejectedMessage, match="unknown room"):
            service.handle_peer(
                protocol.DoneAux(999, 0, 0, 0, 2, 0, 0.0), Aux(999, 1, 20, 0.0).pack(), PREFILL_KEY
            )
        with pytest.raises(RejectedMessage, match="rank 3"):
            service.handle_peer(
                protocol.DoneAux(ROOM, 0, 3, job.slots[0], 2, 0, 0.0),
                Aux(ROOM, 1, 20, 0.0).pack(),
                PREFILL_KEY,
            )
        assert job.state is other.state is RoomState.BOOTSTRAPPING
        assert service.aux.read(other.slots[0]) == bytes(24)  # nothing was written into it
        done(service)
        with pytest.raises(RejectedMessage, match="duplicate done"):
            done(service)  # the duplicate, while the room decodes
        assert job.state is RoomState.SUCCESS and other.state is RoomState.BOOTSTRAPPING

    run(body)


def test_a_failed_room_fences_lent_pages_until_the_prefill_releases_them():
    async def body(service, node):
        job = assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))
        assert (job.state, job.reason) == (RoomState.FAILED, "aborted")
        assert service.aux.free_slots == 4
        assert service.pool.free_pages == 30 and ROOM in service.fenced  # the prefill may still write
        with pytest.raises(RejectedMessage, match="another key"):
            service.handle_peer(protocol.RoomReleased(ROOM, 0, 0, ""), None, CurveKeys.generate().public)
        assert ROOM in service.fenced
        service.handle_peer(protocol.RoomReleased(ROOM, 0, 0, ""), None, PREFILL_KEY)
        assert service.pool.free_pages == 32 and not service.fenced

    run(body)


def test_fenced_pages_come_back_when_the_lease_ends_and_not_before():
    async def body(service, node):
        assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))
        service.check_timeouts(time.monotonic() + 5)
        assert ROOM in service.fenced and service.pool.free_pages == 30
        service.check_timeouts(time.monotonic() + 11)
        assert not service.fenced and service.pool.free_pages == 32
        assert service.health().lent_pages_expired == 2 and service.health().lent_pages_returned == 0

    run(body, lease_timeout_s=10)


def test_an_abort_for_a_silent_peer_keeps_pages_fenced_until_its_late_writes_complete():
    async def body(service, node):
        assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "peer_lost"))  # a TTL, not evidence
        assert ROOM in service.fenced and service.pool.free_pages == 30
        assert service.health().fenced_pages == 2
        with pytest.raises(RejectedMessage):  # a done from another key ends nothing
            service.handle_peer(protocol.DoneAux(ROOM, 0, 0, 0, 2, 0, 0.0), None, "someone-else")
        assert ROOM in service.fenced
        service.handle_peer(protocol.DoneAux(ROOM, 0, 0, 0, 2, 0, 0.0), None, PREFILL_KEY)
        assert not service.fenced and service.pool.free_pages == 32
        assert service.metrics.late_writes._value.get() == 1
        assert service.rooms.find(ROOM).state is RoomState.FAILED
        assert service.pool.closed_lent_pages == {LeaseState.RETURNED: 2}

    run(body, lease_timeout_s=60)


@pytest.mark.parametrize("wrote", [True, False])
def test_a_release_after_the_room_failed_counts_a_late_write_only_if_writes_began(wrote):
    async def body(service, node):
        assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))
        service.handle_peer(protocol.RoomReleased(ROOM, 0, 0, "aborted", wrote), None, PREFILL_KEY)
        assert not service.fenced and service.pool.free_pages == 32
        assert service.metrics.late_writes._value.get() == (1 if wrote else 0)

    run(body)


def test_an_abort_for_a_gone_peer_frees_pages_at_once():
    async def body(service, node):
        assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "peer_lost", peer_gone=True))
        assert not service.fenced and service.pool.free_pages == 32
        assert service.health().lent_pages_revoked == 2

    run(body)


@pytest.mark.parametrize(
    ("steps", "reason"),
    [
        ([], "bootstrap_timeout"),
        (["accept"], "waiting_timeout"),
        (["accept", "start"], "transfer_timeout"),
        (["accept", "start", "done-without-aux"], "aux_timeout"),
    ],
)
def test_each_waiting_state_has_its_timeout(steps, reason):
    async def body(service, node):
        job = assign(service)
        actions = {
            "accept": lambda: accept(service),
            "start": lambda: start(service),
            "done-without-aux": lambda: done(service, aux=False),
        }
        for step in steps:
            actions[step]()
        service.check_timeouts(time.monotonic() + 1000)
        assert (job.state, job.reason) == (RoomState.FAILED, reason)

    run(body)


def test_progress_notices_overtaken_by_done_are_dropped_quietly():
    async def body(service, node):
        job = assign(service)
        done(service)  # done+aux overtook the accept and the start notice
        assert job.state is RoomState.SUCCESS
        start(service)
        accept(service)
        assert job.state is RoomState.SUCCESS
        assert list(job.timestamps) == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]
        with pytest.raises(RejectedMessage, match="unknown room"):
            service.handle_peer(protocol.TransferStarted(ROOM + 5, 0, 0), None, PREFILL_KEY)

    run(body)


def test_a_decode_that_raises_ends_the_outcome_failed_and_is_counted():
    async def body(service, node):
        def broken(*args):
            raise RuntimeError("model bug")

        service.source.decode = broken
        job = assign(service)
        done(service)
        assert job.state is RoomState.SUCCESS
        await until_async(lambda: job.outcome is not None)
        assert (job.outcome, job.reason, job.output_ids) == ("failed", "decode_failed", None)
        assert room_view(job)["state"] == "FAILED" and room_view(job)["transfer_state"] == "SUCCESS"
        assert service.metrics.failures.labels("decode_failed")._value.get() == 1
        assert service.pool.free_pages == 32

    run(body)


def leader_of(service, node):
    return NodeLeader("decode", "d", service, node, 1, None, {})


def test_assignments_reach_the_node_only_from_the_bootstrap():
    async def body(service, node):
        room = protocol.DecodeRoom(ROOM, 20, 5, "p", [PREFILL])
        leader = leader_of(service, node)
        with pytest.raises(RejectedMessage, match="not the bootstrap"):
            leader.on_message(room, None, CurveKeys.generate().public)
        with pytest.raises(RejectedMessage, match="not the bootstrap"):
            service.on_message(room, None, None)  # a rank's own socket takes none: its leader does
        assert not service.rooms.live
        leader.on_message(room, None, None)  # the leader hands it to every rank, this one included
        assert ROOM in service.rooms.live

    run(body)


def test_assignments_are_taken_in_order_and_a_bad_one_costs_only_itself():
    async def test(service, node):
        leader = leader_of(service, node)
        room = protocol.DecodeRoom(ROOM, 20, 5, "p", [PREFILL])
        other = protocol.DecodeRoom(ROOM + 1, 20, 5, "p", [PREFILL])
        batch = protocol.Assignments(
            decode_rooms=[room, room, other], aborts=[protocol.AbortRoom(ROOM + 1, 0, "aborted")]
        )
        leader.on_message(batch, None, None)
        assert ROOM in service.rooms.live  # the duplicate was dropped, and counted
        registry = service.metrics.registry
        assert registry.get_sample_value("kvroom_messages_rejected_total", {"kind": "duplicate"}) == 1
        ended = service.rooms.find(ROOM + 1)
        assert (ended.state, ended.reason) == (RoomState.FAILED, "aborted")  # its abort came after it

        stranger = protocol.Assignments(decode_rooms=[protocol.DecodeRoom(ROOM + 2, 20, 5, "p", [PREFILL])])
        with pytest.raises(RejectedMessage, match="not the bootstrap"):
            leader.on_message(stranger, None, PREFILL_KEY)
        assert service.rooms.find(ROOM + 2) is None

    run(test)


def test_an_abort_that_overtook_its_room_refuses_the_room_when_it_comes():
    """Each bootstrap keeps the order of its own messages, not another's: one's abort can reach
    the node before the other's assignment. The room is then refused: no page, no request."""

    async def test(service, node):
        sent = service.rank.peers.sent
        free = service.pool.free_pages
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))
        with pytest.raises(RejectedMessage, match="already known"):
            service.handle_assignment(protocol.DecodeRoom(ROOM, 20, 5, "p", [PREFILL]))
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))  # a second one changes nothing
        await asyncio.sleep(0)
        assert sent == [] and ROOM not in service.rooms.live and service.pool.free_pages == free
        ended = service.rooms.find(ROOM)
        assert (ended.state, ended.reason) == (RoomState.FAILED, "aborted")

    run(test)


def test_a_turns_transfer_requests_to_one_prefill_rank_go_in_one_message():
    async def test(service, node):
        sent = service.rank.peers.sent
        assign(service)
        assert sent == []  # at the end of the turn
        await asyncio.sleep(0)
        assert [type(m) for m in sent] == [protocol.TransferRequest]  # one room: as it always was
        sent.clear()
        assign(service, ROOM + 1)
        assign(service, ROOM + 2)
        await asyncio.sleep(0)
        assert [type(m) for m in sent] == [protocol.TransferRequests]
        assert [r.transfer for r in sent[0].requests] == [ROOM + 1, ROOM + 2]

    run(test)


def test_requests_that_cannot_be_queued_fail_their_rooms():
    async def test(service, node):
        service.rank.peers.reachable = False
        rooms = [assign(service), assign(service, ROOM + 1)]
        await asyncio.sleep(0)
        assert [(job.state, job.reason) for job in rooms] == [(RoomState.FAILED, "peer_lost")] * 2

    run(test)


def test_an_abort_never_overtakes_the_request_it_cancels():
    async def test(service, node):
        sent = service.rank.peers.sent
        job = assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))  # in the same turn
        assert [type(m) for m in sent] == [protocol.TransferRequest, protocol.RevokeLease]
        assert job.state is RoomState.FAILED
        await asyncio.sleep(0)
        assert len(sent) == 2  # nothing sent twice

    run(test)


def test_a_room_stays_live_while_it_decodes_and_an_abort_ends_it_at_once():
    """A drain must find the rooms still decoding; the abort it sends ends each one at once (the
    node may exit before the decode would end), and the output that comes is dropped."""

    async def body(service, node):
        job = assign(service)
        accept(service)
        start(service)
        done(service)
        assert job.state is RoomState.SUCCESS and job.outcome is None
        assert service.rooms.live.get(ROOM) is job and service.health().rooms_in_flight == 1
        service.handle_assignment(protocol.AbortRoom(transfer=ROOM, rank=0, reason="shutdown"))
        assert (job.outcome, job.reason) == ("failed", "shutdown")
        assert node.reports[-1] is RoomState.SUCCESS  # reported with its outcome, now
        await until_async(lambda: ROOM not in service.rooms.live)
        assert (job.outcome, job.reason, job.output_ids) == ("failed", "shutdown", None)
        assert service.pool.free_pages == 32

    run(body)


def test_a_draining_leader_refuses_rooms_it_has_not_seen():
    """New rooms are refused before any rank takes them (FAILED draining, reported); a room the
    node already holds is still its own, and an abort still reaches it."""

    async def body(service, node):
        leader = leader_of(service, node)
        leader.assign(protocol.DecodeRoom(ROOM, 20, 5, "p", [PREFILL]))
        leader.draining = True
        leader.assign(protocol.DecodeRoom(ROOM + 1, 20, 5, "p", [PREFILL]))
        refused = service.rooms.find(ROOM + 1)
        assert ROOM + 1 not in service.rooms.live and (refused.state, refused.reason) == (
            RoomState.FAILED,
            "draining",
        )
        assert node.reports == [RoomState.FAILED] and service.pool.free_pages == 32 - 2
        with pytest.raises(RejectedMessage):  # the same room again: a duplicate, as before
            leader.assign(protocol.DecodeRoom(ROOM, 20, 5, "p", [PREFILL]))
        leader.assign(protocol.AbortRoom(transfer=ROOM, rank=0, reason="shutdown"))
        assert service.rooms.find(ROOM).state is RoomState.FAILED

    run(body)


@pytest.mark.parametrize("large", [False, True])
def test_verified_pages_that_match_succeed_and_pages_that_cannot_be_digested_fail(monkeypatch, large):
    """At once for a small room, in the digest thread for a large one; a digest that raised
    leaves the pages unverified: the room fails, it never waits or succeeds."""
    from shared.kv import digest as kv_digest

    if large:
        monkeypatch.setattr(kv_digest, "INLINE_BYTES", 0)

    async def body(service, node):
        for room, broken in ((ROOM, False), (ROOM + 1, True)):
            job = assign(service, room)
            pages = job.pages[:2]
            digests = kv_digest.page_digests(service.pool, pages, 0, service.layout.page_bytes)
            if broken:
                monkeypatch.setattr(kv_digest, "page_digests", lambda *a: 1 / 0)
            msg = protocol.DoneAux(room, 0, 0, job.slots[0], 2, 0, 0.0, digests=digests)
            service.handle_peer(msg, Aux(room, 65, 20, -0.5).pack(), PREFILL_KEY)
            await until_async(lambda job=job: not job.checking and job.state is not RoomState.BOOTSTRAPPING)
            expected = (RoomState.FAILED, "kv_corrupt") if broken else (RoomState.SUCCESS, None)
            assert (job.state, job.reason) == expected

    run(body, verify_kv=True)


def test_a_gone_peers_word_for_a_fenced_room_frees_it_and_for_an_unknown_one_is_ignored():
    async def body(service, node):
        assign(service)
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "peer_lost"))
        assert ROOM in service.fenced
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "peer_lost", peer_gone=True))
        assert not service.fenced and service.pool.free_pages == 32
        service.handle_assignment(protocol.AbortRoom(ROOM + 1, 0, "peer_lost", peer_gone=True))
        assert service.rooms.find(ROOM + 1) is None

    run(body)


def test_a_gone_peers_pages_stay_fenced_while_bytes_it_sent_over_tcp_are_unread():
    """Its process ended, but its kernel had sent bytes this process has not read yet: they could
    still land in the pages. The pages go back once they are read, not before."""

    async def body(service, node):
        with loopback_connection() as (writer, reader, _):
            writer.sendall(b"k" * 100)
            writer.close()  # the gone writer's end; 100 bytes and its FIN wait in this process
            await until_async(lambda: not tcp_drain.closed_writes_read(), what="the FIN")
            assign(service)
            service.handle_assignment(protocol.AbortRoom(ROOM, 0, "peer_lost", peer_gone=True))
            await asyncio.sleep(0.1)  # ten looks at the kernel's table: none may free them
            assert ROOM in service.fenced and service.pool.free_pages == 30
            assert reader.recv(200) == b"k" * 100  # the transport reads them
            await until_async(lambda: not service.fenced, what="the pages back")
            assert service.pool.free_pages == 32 and service.health().lent_pages_revoked == 2

    run(body)
