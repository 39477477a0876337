"""The store failing for a moment loses nothing: a report it could not take is sent again (the
cluster's epoch changes once the store answers, and a node that sees a new epoch reports every room
it knows once more), and a change no event told of is read again by whoever waits on it."""

import asyncio

import zmq

from bootstrap.cluster import Cluster
from bootstrap.settings import BootstrapSettings
from bootstrap.store import StoreUnavailable
from shared.room.states import RoomState
from shared.wire import protocol
from shared.wire.security import Security
from tests.support import until
from tests.unit.bootstrap.silent_node import join
from tests.unit.bootstrap.test_api import AUTH, make_client


def epoch(client) -> str:
    return client.put("/nodes/d0/heartbeat", json={}, headers=AUTH).json()["epoch"]


def test_a_report_the_store_failed_on_renews_the_epoch(silent_nodes, monkeypatch):
    prefill, decode = silent_nodes
    with make_client(room_deadline_s=60.0, node_ttl_s=60.0) as client:
        join(client, prefill, decode)
        before = epoch(client)
        room = client.post("/rooms", json={"prompt": "lost report", "max_new_tokens": 3}).json()["room"]
        transfer = decode.messages(until=protocol.DecodeRoom)[0].transfer

        store = client.app.state.cluster.store
        update_room, failed = store.update_room, []

        async def fails_once(*args, **kwargs):
            if not failed:
                failed.append(True)
                raise StoreUnavailable("redis at redis://127.0.0.1:1/0: connection closed by server")
            return await update_room(*args, **kwargs)

        monkeypatch.setattr(store, "update_room", fails_once)
        answer = client.put("/nodes/d0/heartbeat", json={}, headers=AUTH).json()["bootstraps"][0]
        sock = decode.sock.context.socket(zmq.PUSH)
        Security(decode.keys).client(sock, answer["public_key"])
        sock.connect(answer["report_endpoint"])
        try:
            report = protocol.RoomStatus(transfer=transfer, state=int(RoomState.WAITING_FOR_INPUT))
            sock.send_multipart(protocol.encode(protocol.RoomReports("d0", [report])))

            until(lambda: epoch(client) != before, 10, "the epoch to change after a lost report")
            assert failed
            assert client.get(f"/rooms/{room}").json()["transfer_state"] == "BOOTSTRAPPING"  # it was lost
            sock.send_multipart(protocol.encode(protocol.RoomReports("d0", [report])))  # reported again
            until(
                lambda: client.get(f"/rooms/{room}").json()["transfer_state"] == "WAITING_FOR_INPUT",
                10,
                "the report sent again to be applied",
            )
        finally:
            sock.close(0)


def test_a_resync_of_the_store_wakes_every_waiter():
    async def run() -> None:
        cluster = Cluster(BootstrapSettings())
        try:
            async with cluster.watching(5) as first, cluster.watching(9) as second:
                cluster.store.events.resync()
                assert first.is_set() and second.is_set()
        finally:
            await cluster.close()

    asyncio.run(run())
