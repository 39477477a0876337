"""A room on one service: moves only through the table, and keeps its request's outcome apart."""

import pytest

from shared.errors import IllegalTransition
from shared.node.reports import room_view
from shared.room.record import Room, RoomTable
from shared.room.states import FailureReason, RoomState

S = RoomState


def recorded() -> tuple[Room, list[tuple[RoomState, str | None, str | None]]]:
    """A room and the (state, outcome, reason) its on_change callback saw, call by call."""
    seen: list[tuple[RoomState, str | None, str | None]] = []
    room = Room(7, on_change=lambda r: seen.append((r.state, r.outcome, r.reason)))
    return room, seen


def test_a_new_room_is_bootstrapping_with_a_timestamp():
    room = Room(7)
    assert room.state is S.BOOTSTRAPPING and room.reason is None and room.outcome is None
    assert set(room.timestamps) == {"BOOTSTRAPPING"}
    assert not room.finished


def test_advance_follows_the_table_and_tells_each_change():
    room, seen = recorded()
    room.advance(S.WAITING_FOR_INPUT, ts=12.5)
    assert room.timestamps["WAITING_FOR_INPUT"] == 12.5
    with pytest.raises(IllegalTransition):
        room.advance(S.SUCCESS)
    assert room.state is S.WAITING_FOR_INPUT and "SUCCESS" not in room.timestamps
    room.advance_to(S.SUCCESS)
    assert seen == [(S.WAITING_FOR_INPUT, None, None), (S.TRANSFERRING, None, None), (S.SUCCESS, None, None)]
    assert {"TRANSFERRING", "SUCCESS"} <= set(room.timestamps)
    room.advance_to(S.TRANSFERRING)  # not ahead: nothing
    assert len(seen) == 3


def test_fail_ends_a_live_room_once():
    room, seen = recorded()
    assert room.fail(FailureReason.AUX_TIMEOUT)
    assert (room.state, room.reason) == (S.FAILED, "aux_timeout") and room.finished
    assert not room.fail(FailureReason.ABORTED)  # already ended: the first reason stays
    assert room.reason == "aux_timeout" and len(seen) == 1


def test_a_successful_room_cannot_fail_afterwards():
    room = Room(7)
    room.advance_to(S.SUCCESS)
    assert not room.fail(FailureReason.PEER_LOST)
    assert room.state is S.SUCCESS and room.reason is None


def test_end_records_the_outcome_after_a_successful_transfer():
    room, seen = recorded()
    room.advance_to(S.SUCCESS)
    assert not room.finished  # the transfer succeeded; the request has not ended
    room.end("completed")
    assert room.finished and seen[-1] == (S.SUCCESS, "completed", None)
    view = room_view(room)
    assert (view["state"], view["transfer_state"], view["outcome"]) == ("SUCCESS", "SUCCESS", "completed")


def test_a_request_that_failed_after_the_transfer_shows_failed_but_keeps_its_transfer_state():
    room = Room(7)
    room.advance_to(S.SUCCESS)
    room.end("failed", FailureReason.DECODE_FAILED)
    view = room_view(room)
    assert view["state"] == "FAILED" and view["transfer_state"] == "SUCCESS"
    assert view["outcome"] == "failed" and view["reason"] == "decode_failed"
    assert room.state is S.SUCCESS and room.finished


def test_end_is_only_for_a_successful_transfer_and_only_once():
    room = Room(7)
    with pytest.raises(AssertionError):
        room.end("completed")
    room.advance_to(S.SUCCESS)
    room.end("completed")
    with pytest.raises(AssertionError):
        room.end("failed", "again")


def test_view_of_a_failed_room():
    room = Room(7)
    room.output_ids = [1, 2]
    room.finish_reason = None
    room.fail("aborted")
    view = room_view(room)
    assert view["transfer"] == 7 and view["state"] == view["transfer_state"] == "FAILED"
    assert view["reason"] == "aborted" and view["outcome"] is None and view["output_ids"] == [1, 2]
    assert set(view) == {
        "transfer",
        "state",
        "transfer_state",
        "outcome",
        "reason",
        "finish_reason",
        "timestamps",
        "timings",
        "output_ids",
    }


def test_the_table_finds_live_and_finished_rooms_and_forgets_the_oldest():
    table = RoomTable(remember=2)
    rooms = [Room(i) for i in range(1, 5)]
    for room in rooms:
        table.add(room)
    rooms[0].advance(S.WAITING_FOR_INPUT)
    assert sorted(table.states()) == [S.BOOTSTRAPPING] * 3 + [S.WAITING_FOR_INPUT]
    for room in rooms[:3]:
        room.fail("shutdown")
        table.retire(room)
    assert list(table.live) == [4]
    assert table.find(4) is rooms[3] and table.find(3) is rooms[2] and table.find(2) is rooms[1]
    assert table.find(1) is None  # remembered only the last two finished
    assert table.find(99) is None
    assert table.states() == [S.BOOTSTRAPPING]
