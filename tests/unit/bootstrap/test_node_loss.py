"""How a node is lost decides what its peers may free: real CURVE ZMQ to nodes that never answer.

Only positive evidence that the prefill's process can write no more (it left, or another process
registered under its id) lets its decode free the room's pages at once (``peer_gone``); a broken
beat, a re-registration by the same process or silence moves the room and leaves them fenced.
"""

import time

import pytest

from shared.wire import protocol
from tests.unit.bootstrap.silent_node import join
from tests.unit.bootstrap.test_api import AUTH, make_client


def lose(client, prefill, how: str) -> None:
    if how == "left":
        assert client.delete("/nodes/p0", headers=AUTH).status_code == 200
    elif how == "unhealthy":
        beat = {"healthy": False, "problem": "rank 0 exited with code -9"}
        assert client.put("/nodes/p0/heartbeat", json=beat, headers=AUTH).status_code == 200
    elif how in ("restarted", "registered_again"):
        reg = prefill.registration("p0", "prefill")
        if how == "restarted":  # another engine session: another process
            reg["ranks"][0]["session_id"] = "127.0.0.1:4999"
        assert client.post("/nodes", json=reg, headers=AUTH).status_code == 201


@pytest.mark.parametrize(
    ("how", "writes_ended"),
    [("left", True), ("restarted", True), ("registered_again", False), ("unhealthy", False)],
)
def test_only_evidence_that_the_writer_ended_frees_its_decodes_pages_at_once(silent_nodes, how, writes_ended):
    prefill, decode = silent_nodes
    with make_client(max_attempts=1) as client:
        join(client, prefill, decode)
        room = client.post("/rooms", json={"input_ids": [72, 105], "max_new_tokens": 4}).json()["room"]
        (placed,) = decode.messages(protocol.DecodeRoom)
        lose(client, prefill, how)
        aborts = [m for m in decode.messages(protocol.AbortRoom) if isinstance(m, protocol.AbortRoom)]
        assert [(a.transfer, a.reason, a.peer_gone) for a in aborts] == [
            (placed.transfer, "peer_lost", writes_ended)
        ]
        assert client.get(f"/rooms/{room}", params={"wait": 5}).json()["reason"] == "peer_lost"
        metrics = client.get("/metrics").text
        assert f'kvroom_rooms_failed_by_node_loss_total{{evidence="{how}"}} 1.0' in metrics


def test_silence_past_the_ttl_moves_the_room_and_leaves_its_pages_fenced(silent_nodes):
    prefill, decode = silent_nodes
    with make_client(max_attempts=1, node_ttl_s=0.5) as client:
        join(client, prefill, decode)
        client.post("/rooms", json={"input_ids": [72, 105], "max_new_tokens": 4})
        decode.messages(protocol.DecodeRoom)
        deadline = time.monotonic() + 10
        while not decode.sock.poll(50):  # the decode beats; the prefill is silent
            assert time.monotonic() < deadline, "the silent prefill was never taken for dead"
            assert client.put("/nodes/d0/heartbeat", json={}, headers=AUTH).status_code == 200
        aborts = [m for m in decode.messages(protocol.AbortRoom) if isinstance(m, protocol.AbortRoom)]
        assert [(a.reason, a.peer_gone) for a in aborts] == [("peer_lost", False)]
        metrics = client.get("/metrics").text
        assert 'kvroom_rooms_failed_by_node_loss_total{evidence="missed_heartbeats"} 1.0' in metrics


def test_a_prefill_that_leaves_after_its_rooms_failed_unfences_them_on_their_decode(silent_nodes):
    prefill, decode = silent_nodes
    with make_client(max_attempts=1) as client:
        join(client, prefill, decode)
        client.post("/rooms", json={"input_ids": [72, 105], "max_new_tokens": 4})
        (placed,) = decode.messages(protocol.DecodeRoom)
        lose(client, prefill, "unhealthy")  # the room fails; its pages stay fenced
        (fenced,) = [m for m in decode.messages(protocol.AbortRoom) if isinstance(m, protocol.AbortRoom)]
        assert not fenced.peer_gone
        lose(client, prefill, "left")  # now nothing of it can land
        (gone,) = [m for m in decode.messages(protocol.AbortRoom) if isinstance(m, protocol.AbortRoom)]
        assert (gone.transfer, gone.peer_gone) == (placed.transfer, True)
