"""The last line of defence: a room that never ends by itself ends FAILED deadline, and both of its
nodes hear so. The nodes here are real CURVE-serving ZMQ sockets that take rooms and never answer."""

import concurrent.futures

from bootstrap import rooms
from bootstrap.store import Attempt, RoomData
from shared.room.states import RoomState
from shared.wire import protocol
from tests.support import until
from tests.unit.bootstrap.silent_node import join
from tests.unit.bootstrap.test_api import AUTH, make_client


def test_a_room_past_its_deadline_ends_failed_and_both_nodes_are_told(silent_nodes):
    prefill, decode = silent_nodes
    with make_client(room_deadline_s=1.0, node_ttl_s=60.0) as client:
        join(client, prefill, decode)
        room = client.post("/rooms", json={"prompt": "never ends", "max_new_tokens": 3}).json()["room"]
        final = client.get(f"/rooms/{room}", params={"wait": 10}).json()
        assert (final["state"], final["reason"], final["finished"]) == ("FAILED", "deadline", True)
        assert len(final["attempts"]) == 1  # the deadline is final: no other placement
        for node, placed in ((prefill, protocol.PrefillRoom), (decode, protocol.DecodeRoom)):
            got = node.messages(until=protocol.AbortRoom)
            assert [type(m) for m in got] == [placed, protocol.AbortRoom]
            assert (got[1].transfer, got[1].reason) == (got[0].transfer, "deadline")
        assert 'kvroom_room_failures_total{reason="deadline"} 1.0' in client.get("/metrics").text


def test_a_room_no_node_reports_on_has_its_assignments_sent_again_then_is_placed_again(silent_nodes):
    """Assignments can be lost (a bootstrap killed while they sat in its ZMQ I/O thread): a room
    neither node has said a word about is assigned again, the same transfer to the same nodes, and
    after two such tries its attempt fails and it is placed anew."""
    prefill, decode = silent_nodes
    with make_client(room_deadline_s=60.0, node_ttl_s=60.0) as client:
        join(client, prefill, decode)
        room = client.post("/rooms", json={"prompt": "lost", "max_new_tokens": 3}).json()["room"]
        for node, placed in ((prefill, protocol.PrefillRoom), (decode, protocol.DecodeRoom)):
            got = node.messages(until=protocol.AbortRoom, timeout_ms=20_000)
            sent, abort = got[:3], got[3]
            assert [type(m) for m in sent] == [placed] * 3 and sent[0] == sent[1] == sent[2]
            assert sent[0].transfer == room  # the first attempt's transfer id is the room's
            assert (abort.transfer, abort.reason) == (room, "peer_lost")
        assert "kvroom_room_assignments_resent_total 2.0" in client.get("/metrics").text
        body = client.get(f"/rooms/{room}").json()
        assert len(body["attempts"]) == 2 and body["attempts"][0]["reason"] == "peer_lost"


def test_only_a_placed_room_no_node_reported_on_counts_as_unheard():
    now = 1000.0
    placed = Attempt(7, "p0", "d0", placed_at=now - 3)
    room = RoomData(
        room=7, input_ids=[1], max_new_tokens=1, stop=[], stream=False, created=now - 10, attempts=[placed]
    )
    assert rooms.unheard(room, now, 2.0)
    assert not rooms.unheard(room, now - 1.5, 2.0)  # sent too recently
    room.attempt.node_states = {"decode": {"state": "WAITING_FOR_INPUT"}}
    assert not rooms.unheard(room, now, 2.0)
    room.attempt.node_states = {}
    room.attempt.placed_at = 0.0  # not placed yet (an attempt waiting for a node), or a record from before
    assert not rooms.unheard(room, now, 2.0)
    room.attempt.placed_at = now - 3
    room.state = RoomState.WAITING_FOR_INPUT
    assert not rooms.unheard(room, now, 2.0)
    room.state, room.done = RoomState.BOOTSTRAPPING, True
    assert not rooms.unheard(room, now, 2.0)


def test_a_room_waits_for_a_node_that_is_only_late_and_is_refused_once_it_is_dead(silent_nodes):
    """A heartbeat late on a busy host is no death: the room waits in the placement queue and is
    placed when the beat comes. A node that stays silent past its TTL is dead: 503 at once."""
    prefill, decode = silent_nodes
    with make_client(room_deadline_s=60.0, node_ttl_s=5.0) as client:
        for node, (node_id, role) in ((prefill, ("p0", "prefill")), (decode, ("d0", "decode"))):
            reg = {**node.registration(node_id, role), "heartbeat_interval_s": 0.2}
            assert client.post("/nodes", json=reg, headers=AUTH).status_code == 201
        until(lambda: not any(n["placeable"] for n in client.get("/nodes").json()), 5, "both nodes late")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            posted = pool.submit(client.post, "/rooms", json={"prompt": "waits", "max_new_tokens": 3})
            until(lambda: "kvroom_queued_rooms 1.0" in client.get("/metrics").text, 5, "the room queued")
            for node_id in ("p0", "d0"):
                assert client.put(f"/nodes/{node_id}/heartbeat", json={}, headers=AUTH).status_code == 200
            assert posted.result(timeout=10).status_code == 201
        assert prefill.messages(until=protocol.PrefillRoom)
        until(lambda: not any(n["alive"] for n in client.get("/nodes").json()), 15, "both nodes dead")
        refused = client.post("/rooms", json={"prompt": "no node", "max_new_tokens": 3})
        assert (refused.status_code, refused.json()["detail"]) == (503, "no live prefill node")
