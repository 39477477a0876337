"""10,000 random and mutated frames into each ZMQ port while real rooms run beside them."""

import threading

import zmq

from shared.model import encode_text, generate
from tests.integration.fuzz_frames import fuzz_frames
from tests.integration.helpers import metric, pools_full, wait_for

FRAMES_PER_PORT = 10_000


def blast(port: int, seed: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        for frames in fuzz_frames(seed, FRAMES_PER_PORT):
            sock.send_multipart(frames)
    finally:
        sock.close()
        ctx.term()


def test_fuzzed_ports_never_take_a_node_down(stack, model):
    prefill, decode = stack.start()
    targets = [prefill, decode, stack.bootstrap]
    prompts = [f"beside the fuzz {i} " * (1 + i % 5) for i in range(16)]
    with stack.client() as client:
        rooms = [
            client.post("/rooms", json={"prompt": p, "max_new_tokens": 6}).json()["room"] for p in prompts[:8]
        ]
        blasters = [threading.Thread(target=blast, args=(s.zmq_port, seed)) for seed, s in enumerate(targets)]
        for t in blasters:
            t.start()
        rooms += [
            client.post("/rooms", json={"prompt": p, "max_new_tokens": 6}).json()["room"] for p in prompts[8:]
        ]
        for t in blasters:
            t.join(120)
            assert not t.is_alive()
        for service in targets:
            wait_for(
                lambda s=service: metric(s, "kvroom_messages_received_total") >= FRAMES_PER_PORT,
                120,
                f"{service.name} to read every frame",
            )
            assert service.running
            assert metric(service, "kvroom_messages_rejected_total", 'kind="internal"') == 0
        for prompt, room in zip(prompts, rooms, strict=True):
            final = client.get(f"/rooms/{room}", params={"wait": 60}).json()
            assert final["state"] == "SUCCESS", final
            assert final["output_ids"] == generate(model, encode_text(prompt), 6)
        # Nothing from the fuzz took a page or a slot: room assignments need the cluster's token.
        assert metric(decode, "kvroom_messages_rejected_total", 'kind="unauthorized"') > 0
        wait_for(lambda: pools_full(prefill, decode), 10, "pools back to full")
        assert client.get("/health").json()["status"] == "ok"
