"""When a node's room reports leave for the bootstrap: a finished room at the end of the turn, or
REPORT_DELAY_S later while other rooms are in flight; progress later."""

import asyncio

from shared.node import reports
from shared.node.reports import BootstrapLink
from shared.room.record import Room
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.registration import Bootstrap
from tests.support import until_async


def reports_of(sent: list[list[bytes]]) -> list[list[tuple[int, int, str | None]]]:
    out = []
    for frames in sent:
        msg, _ = protocol.decode(frames)
        assert isinstance(msg, protocol.RoomReports)
        out.append([(r.transfer, r.state, r.outcome) for r in msg.reports])
    return out


def make(sent: list[list[bytes]]) -> BootstrapLink:
    link = BootstrapLink(
        "n", lambda endpoint, key, frames: sent.append(frames) or True, asyncio.get_running_loop()
    )
    link.report_to(Bootstrap(id="b", report_endpoint="tcp://127.0.0.1:1", public_key=""))
    return link


def finished(room_id: int) -> Room:
    room = Room(room_id)
    room.advance_to(RoomState.SUCCESS)
    room.end("completed")
    return room


def test_a_lone_room_waits_for_nothing_and_with_others_in_flight_it_waits_for_theirs():
    async def main() -> None:
        sent: list[list[bytes]] = []
        m = make(sent)
        room = Room(1)
        m.live = {1: room}  # its own entry is not another room
        room.advance_to(RoomState.SUCCESS)
        m.report(room)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(sent) == 1  # at the end of the turn, no timer waited for
        room.end("completed")  # its finish, right after its SUCCESS went: not held either
        m.report(room)
        assert m._report_due <= m.loop.time()
        await until_async(lambda: len(sent) == 2)
        m.live = {}
        m.report(finished(2))
        m.report(finished(3))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(sent) == 3
        assert reports_of(sent)[2] == [(2, 4, "completed"), (3, 4, "completed")]
        m.live = {9: Room(9)}  # another room in flight: held REPORT_DELAY_S for the rooms that end with it
        m.report(finished(4))
        assert m._report_due >= m.loop.time() + reports.REPORT_DELAY_S * 0.5
        m.report(finished(5))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert len(sent) == 3
        await until_async(lambda: len(sent) == 4)
        assert reports_of(sent)[3] == [(4, 4, "completed"), (5, 4, "completed")]

    asyncio.run(main())


def test_progress_waits_and_a_transfer_that_ended_goes_at_the_end_of_the_loops_turn(monkeypatch):
    monkeypatch.setattr(reports, "PROGRESS_REPORT_DELAY_S", 10.0)

    async def main() -> None:
        sent: list[list[bytes]] = []
        m = make(sent)
        room = Room(4)
        room.advance_to(RoomState.TRANSFERRING)
        m.report(room)
        await asyncio.sleep(reports.REPORT_DELAY_S * 3)
        assert sent == []
        room.advance_to(RoomState.SUCCESS)  # the transfer ended (what a client waits for), not the room
        m.report(room)
        assert m._report_due <= m.loop.time()
        await until_async(lambda: len(sent) == 1)
        assert reports_of(sent) == [[(4, 4, None)]]

    asyncio.run(main())
