"""When a prefill rank tells its decode that the request was accepted and the write began, in
process, with the fake engine (no transfer is proven here)."""

import asyncio
import threading

import pytest
import uvloop

from launcher.local_stack import free_port
from prefill_node.role import PREFILL
from prefill_node.settings import PrefillSettings
from shared.errors import RejectedMessage
from shared.metrics import ServiceMetrics
from shared.models.source import make_source
from shared.node.agreement import Solo
from shared.node.builder import build_service, make_rank
from shared.node.leader import NodeLeader
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.security import Security
from tests.support import until_async
from tests.support.fakes import FakeEngine, RecordingLink, RecordingPeers
from tests.support.sockets import SMALL, loopback_connection

ROOM = 41
DECODE = protocol.PeerRank(0, "decode", "tcp://127.0.0.1:9", "", 0, 4)


class GatedEngine(FakeEngine):
    """Writes wait until ``gate`` is set."""

    def __init__(self, directory: dict[str, list[tuple[int, int]]]):
        super().__init__("prefill", directory)
        self.gate = threading.Event()

    def write(self, peer_session, writes, timeout_s=30.0):
        self.gate.wait(10)
        return super().write(peer_session, writes, timeout_s)


def run(test, **settings):
    """Runs ``test(service, engine, sent)``; ``sent`` collects what the rank sent its peers
    (done+aux leaves from the transfer thread, on its own sockets, and is not among them)."""

    async def main():
        s = PrefillSettings(
            http_port=free_port(),
            zmq_port=free_port(),
            num_pages=32,
            zmq_security="plain",
            model="synthetic",
            **settings,
        )
        directory: dict[str, list[tuple[int, int]]] = {"decode": [(0, 1 << 62)]}
        engine = GatedEngine(directory)
        peers = RecordingPeers()
        rank = make_rank(s, 0, make_source(s, 0, None), Security(None), engine, peers=peers)
        loop = asyncio.get_running_loop()
        service = build_service(PREFILL, rank, RecordingLink(), Solo, ServiceMetrics("prefill"), loop)
        sent = peers.sent
        try:
            await test(service, engine, sent)
        finally:
            engine.gate.set()
            service.shutdown()
            rank.push.close()
            rank.zmq.term()

    uvloop.run(main())


def room_and_request(service, tokens=4):
    service.handle_assignment(protocol.PrefillRoom(ROOM, [65] * tokens, "decode-0", [DECODE]))
    job = service.rooms.live[ROOM]
    pages = list(range(service.layout.pages_for(tokens)))
    request = protocol.TransferRequest(
        ROOM, 0, 0, service.pool.base_ptr, 32, DECODE.kv_head_count * service.layout.head_bytes, pages, 0
    )
    service.handle_peer(request, None, None)
    return job


def kinds(sent):
    return [type(m).__name__ for m in sent]


NOTICE_S = 0.5


def test_a_room_written_before_its_notices_are_due_sends_none():
    async def test(service, engine, sent):
        job = room_and_request(service)
        engine.gate.set()
        await until_async(lambda: job.state is RoomState.SUCCESS)
        assert kinds(sent) == []
        service._notify(job, 0)  # the notices fall due after the room was written: none goes
        assert kinds(sent) == []

    run(test, progress_notice_s=60)  # never due while the test runs: the order is the test's


def test_a_slow_write_is_announced_once_its_notices_are_due():
    async def test(service, engine, sent):
        job = room_and_request(service)
        await asyncio.sleep(0.05)
        assert kinds(sent) == []  # not yet due
        await until_async(lambda: kinds(sent) == ["TransferAccepted", "TransferStarted"])
        engine.gate.set()
        await until_async(lambda: job.state is RoomState.SUCCESS)
        assert kinds(sent) == ["TransferAccepted", "TransferStarted"]  # told once
        assert all(m.transfer == ROOM and m.rank == 0 for m in sent)

    run(test, progress_notice_s=NOTICE_S)


def test_a_request_that_waits_for_its_kv_is_accepted_then_started():
    async def test(service, engine, sent):
        held = threading.Event()
        service.source.inline = False  # the KV is computed in the model thread, held up here
        service.model.submit(held.wait, 10)
        job = room_and_request(service)
        await until_async(lambda: kinds(sent) == ["TransferAccepted"])
        held.set()
        await until_async(lambda: kinds(sent) == ["TransferAccepted", "TransferStarted"])
        engine.gate.set()
        await until_async(lambda: job.state is RoomState.SUCCESS)

    run(test, progress_notice_s=0.1)


@pytest.mark.parametrize("ready", [True, False])
def test_notices_at_once(ready):
    async def test(service, engine, sent):
        held = threading.Event()
        if not ready:
            service.source.inline = False
            service.model.submit(held.wait, 10)
        job = room_and_request(service)
        assert kinds(sent) == (["TransferAccepted", "TransferStarted"] if ready else ["TransferAccepted"])
        held.set()
        await until_async(lambda: kinds(sent) == ["TransferAccepted", "TransferStarted"])
        engine.gate.set()
        await until_async(lambda: job.state is RoomState.SUCCESS)

    run(test, progress_notice_s=0)


def test_a_batch_of_requests_is_taken_request_by_request():
    async def test(service, engine, sent):
        for room in (ROOM, ROOM + 1):
            service.handle_assignment(protocol.PrefillRoom(room, [65] * 4, "decode-0", [DECODE]))
        pages = list(range(service.layout.pages_for(4)))
        page_bytes = DECODE.kv_head_count * service.layout.head_bytes
        good = protocol.TransferRequest(ROOM, 0, 0, service.pool.base_ptr, 32, page_bytes, pages, 0)
        bad = protocol.TransferRequest(ROOM + 1, 0, 0, service.pool.base_ptr, 32, page_bytes + 1, pages, 1)
        service.handle_peer(protocol.TransferRequests([bad, good]), None, None)
        engine.gate.set()
        await until_async(lambda: service.rooms.find(ROOM).state is RoomState.SUCCESS)
        rejected = service.metrics.registry.get_sample_value(
            "kvroom_messages_rejected_total", {"kind": "invalid"}
        )
        assert rejected == 1
        assert service.rooms.find(ROOM + 1).requests == {}  # the bad one was not taken

    run(test, progress_notice_s=0.1)


def test_an_abort_that_overtook_its_room_refuses_the_room_when_it_comes():
    """One bootstrap's abort can reach the node before another's assignment: the room is refused
    when it comes, and a request for it is turned away as for a finished room."""

    async def test(service, engine, sent):
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))
        with pytest.raises(RejectedMessage, match="already known"):
            service.handle_assignment(protocol.PrefillRoom(ROOM, [65] * 4, "decode-0", [DECODE]))
        service.handle_assignment(protocol.AbortRoom(ROOM, 0, "aborted"))  # a second one changes nothing
        request = protocol.TransferRequest(ROOM, 0, 0, 0, 32, DECODE.kv_head_count * 8, [0], 0)
        with pytest.raises(RejectedMessage, match="finished room"):
            service.handle_peer(request, None, None)
        await asyncio.sleep(0)
        assert sent == [] and ROOM not in service.rooms.live and engine.writes == []
        ended = service.rooms.find(ROOM)
        assert (ended.state, ended.reason) == (RoomState.FAILED, "aborted")

    run(test)


def test_a_request_for_pages_of_one_layer_each_is_refused():
    """A vLLM decode's request (its pages one layer each) never reaches a kvroom prefill through
    the bootstrap, which refuses to mix the two; sent anyway, it is refused and nothing is written."""

    async def test(service, engine, sent):
        service.handle_assignment(protocol.PrefillRoom(ROOM, [65] * 4, "decode-0", [DECODE]))
        pages = list(range(service.layout.pages_for(4)))
        page_bytes = DECODE.kv_head_count * service.layout.head_bytes
        request = protocol.TransferRequest(
            ROOM, 0, 0, service.pool.base_ptr, 32, page_bytes, pages, 0, layer_stride=page_bytes * 32
        )
        with pytest.raises(RejectedMessage, match="one layer each"):
            service.handle_peer(request, None, None)
        assert service.rooms.find(ROOM).requests == {}

    run(test, progress_notice_s=0)


def test_a_node_whose_rank_died_holds_its_writes_over_while_the_kernel_still_sends_for_the_dead():
    """A dead rank writes nothing, but what its sockets held its kernel goes on sending: the node
    says its writes are over (and leaves, freeing its peers' pages) only once every byte and FIN
    of a connection no process holds is acknowledged."""

    async def body(service, engine, sent):
        leader = NodeLeader("prefill", "p", service, RecordingLink(), 2, None, {1: None})
        leader.rank_died(1, "exited with code -9")
        assert leader.writes_over(0.0)  # rank 0 writes nothing, and no dead socket holds bytes
        with loopback_connection() as (writer, reader, _):
            with pytest.raises(BlockingIOError):
                writer.setblocking(False)
                while True:
                    writer.send(b"k" * SMALL)
            writer.close()  # as the rank's exit does: the kernel keeps what it had not sent
            assert not leader.writes_over(0.0)
            while reader.recv(1 << 16):
                pass  # the decode's transport takes it all, and the FIN
            await until_async(lambda: leader.writes_over(0.0), what="every byte acknowledged")

    run(body)
