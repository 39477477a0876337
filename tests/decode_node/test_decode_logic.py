"""The decode node's SUCCESS rule, in process, with the fake engine (no transfer is proven here)."""

import asyncio

import pytest
import uvloop

from decode_node.service import DecodeService
from decode_node.settings import DecodeSettings
from shared import protocol
from shared.aux_buffers import Aux
from shared.errors import RejectedMessage
from launcher.local_stack import free_port
from shared.node import PROGRESS_REPORT_DELAY_S, REPORT_DELAY_S
from shared.states import RoomState
from shared.transfer import FakeEngine

PREFILL = protocol.PeerRank(rank=0, session_id="prefill:1", zmq_endpoint="tcp://127.0.0.1:9")
ROOM = 77


def run(test):
    """Runs ``test`` on uvloop, the loop the nodes run on."""

    async def main():
        settings = DecodeSettings(http_port=free_port(), zmq_port=free_port(), num_pages=32, aux_slots=4)
        service = DecodeService(settings, FakeEngine("decode", {}))
        service.loop = asyncio.get_running_loop()
        service.token = "t"
        try:
            await test(service)
        finally:
            service._push.close()
            service.zmq.term()

    uvloop.run(main())


def assign(service, room=ROOM, prompt_len=20):
    service.handle(protocol.DecodeRoom(room, 0, "t", prompt_len, 5, "p", [PREFILL]), None)
    return service.rooms.live[room]


def done(service, room=ROOM, aux_room=ROOM, slot=None, cached=20, aux=True):
    job = service.rooms.find(ROOM)
    msg = protocol.KvDone(room, 0, 0, job.aux_slot if slot is None else slot, 2, 0, 0.0)
    record = Aux(aux_room, 65, cached, -0.5).pack() if aux else None
    service.handle(msg, record)


def test_success_needs_accept_start_done_and_a_valid_aux():
    async def body(service):
        job = assign(service)
        assert job.state.name == "BOOTSTRAPPING"
        assert service.pool.free_pages == 32 - 2 and service.aux.free_slots == 3
        service.handle(protocol.TransferAccepted(ROOM, 0, 0), None)
        assert job.state.name == "WAITING_FOR_INPUT"
        service.handle(protocol.TransferStarted(ROOM, 0, 0), None)
        assert job.state.name == "TRANSFERRING"
        done(service, aux=False)  # the KV is done, the aux is not here
        assert job.state.name == "TRANSFERRING"
        done(service)
        assert job.state.name == "SUCCESS"
        assert service.aux.free_slots == 4  # read and zeroed before decoding
        await asyncio.sleep(0.2)  # the decode task
        assert job.output_ids is not None and len(job.output_ids) == 5
        assert service.pool.free_pages == 32

    run(body)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [({"aux_room": ROOM + 1}, "aux_invalid"), ({"cached": 3}, "aux_invalid")],
)
def test_aux_that_is_not_the_rooms_fails_it(kwargs, reason):
    async def body(service):
        job = assign(service)
        done(service, **kwargs)
        assert (job.state.name, job.reason) == ("FAILED", reason)
        assert service.aux.free_slots == 4
        assert service.pool.free_pages == 32  # the prefill answered for its pages with the done

    run(body)


def test_foreign_slot_duplicate_and_unknown_room_are_rejected_without_effect():
    async def body(service):
        job = assign(service)
        other = assign(service, room=ROOM + 1)
        with pytest.raises(RejectedMessage, match="not this room"):
            done(service, slot=other.aux_slot)  # someone else's slot
        with pytest.raises(Exception, match="unknown room"):
            service.handle(protocol.KvDone(999, 0, 0, 0, 2, 0, 0.0), Aux(999, 1, 20, 0.0).pack())
        with pytest.raises(Exception, match="rank 3"):
            service.handle(protocol.KvDone(ROOM, 0, 3, job.aux_slot, 2, 0, 0.0), Aux(ROOM, 1, 20, 0.0).pack())
        assert job.state.name == other.state.name == "BOOTSTRAPPING"
        assert service.aux.read(other.aux_slot).room == 0  # nothing was written into it
        done(service)
        with pytest.raises(Exception, match="finished"):
            done(service)  # the duplicate
        assert job.state.name == "SUCCESS" and other.state.name == "BOOTSTRAPPING"

    run(body)


def test_abort_fences_lent_pages_until_the_prefill_releases_them():
    async def body(service):
        job = assign(service)
        service.handle(protocol.AbortRoom(ROOM, 0, "t", "aborted"), None)
        assert (job.state.name, job.reason) == ("FAILED", "aborted")
        assert service.aux.free_slots == 4
        assert service.pool.free_pages == 30 and ROOM in service.fenced  # the prefill may still write
        service.handle(protocol.RoomReleased(ROOM, 0, 0, ""), None)
        assert service.pool.free_pages == 32 and not service.fenced

    run(body)


def test_an_abort_without_the_cluster_token_is_refused():
    async def body(service):
        job = assign(service)
        with pytest.raises(Exception, match="token"):
            service.handle(protocol.AbortRoom(ROOM, 0, "guess", "aborted"), None)
        assert job.state.name == "BOOTSTRAPPING"

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
    async def body(service):
        job = assign(service)
        actions = {
            "accept": lambda: service.handle(protocol.TransferAccepted(ROOM, 0, 0), None),
            "start": lambda: service.handle(protocol.TransferStarted(ROOM, 0, 0), None),
            "done-without-aux": lambda: done(service, aux=False),
        }
        for step in steps:
            actions[step]()
        import time

        service._check_timeouts(time.time() + 1000, time.monotonic() + 1000)
        assert (job.state.name, job.reason) == ("FAILED", reason)

    run(body)


def test_progress_notices_overtaken_by_done_are_dropped_quietly():
    async def body(service):
        job = assign(service)
        done(service)  # done+aux overtook the accept and the start notice
        assert job.state.name == "SUCCESS"
        service.handle(protocol.TransferStarted(ROOM, 0, 0), None)
        service.handle(protocol.TransferAccepted(ROOM, 0, 0), None)
        assert job.state.name == "SUCCESS"
        assert list(job.timestamps) == ["BOOTSTRAPPING", "WAITING_FOR_INPUT", "TRANSFERRING", "SUCCESS"]
        with pytest.raises(RejectedMessage, match="unknown room"):
            service.handle(protocol.TransferStarted(ROOM + 5, 0, 0), None)

    run(body)


def test_progress_is_reported_lazily_and_an_ending_promptly_in_one_message():
    async def body(service):
        sent = []
        service._report_endpoint = "tcp://bootstrap"
        service.send = lambda endpoint, frames: sent.append(protocol.decode(frames)[0]) or True
        loop = asyncio.get_running_loop()
        assign(service)
        service.handle(protocol.TransferAccepted(ROOM, 0, 0), None)
        service.handle(protocol.TransferStarted(ROOM, 0, 0), None)
        assert service._report_due - loop.time() > PROGRESS_REPORT_DELAY_S / 2
        done(service)  # the room ended: its report is due at once, progress and all
        assert service._report_due - loop.time() < PROGRESS_REPORT_DELAY_S / 2
        await asyncio.sleep(REPORT_DELAY_S * 5)
        reports = [m for m in sent if isinstance(m, protocol.RoomReports)]
        assert [s.state for s in reports[0].reports] == [RoomState.SUCCESS]
        assert list(reports[0].reports[0].timestamps) == [
            "BOOTSTRAPPING",
            "WAITING_FOR_INPUT",
            "TRANSFERRING",
            "SUCCESS",
        ]

    run(body)
