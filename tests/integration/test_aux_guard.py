"""SUCCESS waits for the aux: the room's done+aux message is held back by a proxy."""

from shared import protocol
from shared.model import encode_text, generate
from tests.integration.helpers import metric, node_room, pools_full, wait_for
from tests.integration.holding_proxy import HoldingProxy


def test_room_is_not_success_until_its_aux_arrives(stack, model):
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    decode = stack.node("decode", "decode-0")

    def hold(msg: protocol.Message) -> bool:
        return isinstance(msg, protocol.KvDone)

    with HoldingProxy(decode.zmq_port, hold) as proxy:
        decode.args += ["--advertise-zmq-port", str(proxy.port)]
        decode.start()
        prefill = stack.node("prefill", "prefill-0").start()
        decode.wait_healthy()
        prefill.wait_healthy()
        with stack.client() as client:
            # A room beside the held one must go on unaffected.
            other = client.post("/rooms", json={"prompt": "a neighbour", "max_new_tokens": 6}).json()
            prompt = "held back " * 10
            room = client.post("/rooms", json={"prompt": prompt, "max_new_tokens": 8}).json()["room"]
            wait_for(lambda: proxy.held_rooms() == {room, other["room"]}, 20, "both done+aux messages held")
            proxy.release(other["room"])

            # KV writes completed (prefill is done), the aux is missing: not SUCCESS.
            assert node_room(prefill, room)["state"] == "SUCCESS"
            for _ in range(10):
                assert node_room(decode, room)["state"] == "TRANSFERRING"
                assert client.get(f"/rooms/{room}").json()["state"] == "TRANSFERRING"
            assert client.get(f"/rooms/{other['room']}", params={"wait": 30}).json()["state"] == "SUCCESS"

            # The done notice alone, its aux frame cut off: the KV is done, the aux is not here.
            assert proxy.held_rooms() == {room}
            proxy.inject(proxy.held[0][:2])
            wait_for(
                lambda: metric(decode, "kvroom_messages_rejected_total", 'kind="aux_missing"') == 1,
                10,
                "the done notice without aux to be seen",
            )
            for _ in range(10):
                assert node_room(decode, room)["state"] == "TRANSFERRING"

            proxy.release()
            final = client.get(f"/rooms/{room}", params={"wait": 30}).json()
            assert final["state"] == "SUCCESS", final
            assert final["output_ids"] == generate(model, encode_text(prompt), 8)
            wait_for(lambda: pools_full(prefill, decode), 10, "pools back to full")
