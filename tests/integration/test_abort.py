"""DELETE /rooms/{room} on a room in flight: FAILED aborted on both nodes, pages back."""

from shared.wire import protocol
from tests.integration.helpers import metric, node_transfer, pools_full
from tests.integration.holding_proxy import in_front_of
from tests.support import until


def test_abort_in_flight_room(stack):
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0")

    def hold(msg: protocol.Message) -> bool:
        return isinstance(msg, protocol.TransferRequest)

    # The decode's transfer request is held, so the room stays in flight until we abort it.
    with in_front_of(prefill, hold) as proxy:
        prefill.start()
        decode = stack.node("decode", "decode-0").start()
        prefill.wait_healthy()
        decode.wait_healthy()
        with stack.client() as client:
            room = client.post("/rooms", json={"prompt": "abort me " * 20, "max_new_tokens": 50}).json()[
                "room"
            ]
            until(lambda: proxy.held_rooms() == {room}, 20, "the transfer request to be held")
            until(lambda: node_transfer(prefill, room)["state"] == "WAITING_FOR_INPUT", 20, "prefill to wait")
            # The decode has not heard back from its prefill: still bootstrapping.
            assert node_transfer(decode, room)["state"] == "BOOTSTRAPPING"
            assert decode.health()["free_pages"] < decode.health()["total_pages"]

            resp = client.delete(f"/rooms/{room}")
            assert resp.status_code == 200
            assert resp.json()["state"] == "FAILED" and resp.json()["reason"] == "aborted"
            for node in (prefill, decode):
                until(lambda node=node: node_transfer(node, room)["state"] == "FAILED", 10, "node to fail")
                assert node_transfer(node, room)["reason"] == "aborted"
            until(lambda: pools_full(prefill, decode), 10, "pages and aux slots back")
            final = client.get(f"/rooms/{room}").json()
            assert final["state"] == "FAILED" and final["reason"] == "aborted"
            assert final["output_ids"] is None and final["finished"]
            # A second abort is refused, the room stays as it ended.
            assert client.delete(f"/rooms/{room}").status_code == 409

            # The late request reaches the prefill: it is refused, nothing is written.
            proxy.release()
            until(
                lambda: metric(prefill, "kvroom_messages_rejected_total", 'kind="finished"') == 1,
                10,
                "the late request to be refused",
            )
            assert metric(prefill, "kvroom_transfer_bytes_total") == 0
            assert pools_full(prefill, decode)

            # The nodes go on serving.
            after = client.post("/rooms", json={"prompt": "next", "max_new_tokens": 3}).json()["room"]
            until(lambda: proxy.held_rooms() == {after}, 20, "the next request")
            proxy.release()
            assert client.get(f"/rooms/{after}", params={"wait": 30}).json()["state"] == "SUCCESS"
            assert metric(stack.bootstrap, "kvroom_room_failures_total", 'reason="aborted"') == 1
