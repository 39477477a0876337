"""Strangers and fuzz at every ZMQ port while real rooms run beside them.

A client without CURVE never gets a message through. A client with a key of
its own (CURVE proves only that it holds the key) gets its messages read and
refused: nothing it sends is taken as the bootstrap's or a room's peer. 10,000
random and mutated frames into each port, from strangers and from a member's
key, take no node down and change no room.
"""

import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.models.reference import encode_text, generate
from shared.wire.security import CurveKeys, Security
from tests.integration.fuzz_frames import fuzz_frames
from tests.integration.helpers import metric, pools_full
from tests.support import until

FRAMES_PER_PORT = 10_000
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)


def blast(port: int, server_key: str, keys: CurveKeys, seed: int, count: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    Security(keys).client(sock, server_key)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        for frames in fuzz_frames(seed, count):
            sock.send_multipart(frames)
    finally:
        sock.close()
        ctx.term()


def plain_client_is_refused(port: int) -> bool:
    """A client without CURVE sends; wait until its handshake fails, and say whether it did."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket()
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([b"KVRM\x00\x02\x03", b"\x80"], flags=zmq.NOBLOCK)
    try:
        while monitor.poll(10_000):
            if recv_monitor_message(monitor)["event"] in HANDSHAKE_FAILED:
                return True
        return False
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()


def test_strangers_and_fuzz_never_take_a_node_down(stack, model):
    prefill, decode = stack.start()
    targets = [prefill, decode, stack.bootstrap]
    before = [metric(s, "kvroom_messages_received_total") for s in targets]
    for service in targets:
        assert plain_client_is_refused(service.zmq_port), service.name
    # Nothing the plain clients sent was read.
    assert [metric(s, "kvroom_messages_received_total") for s in targets] == before

    prompts = [f"beside the fuzz {i} " * (1 + i % 5) for i in range(16)]
    with stack.client() as client:
        rooms = [
            client.post("/rooms", json={"prompt": p, "max_new_tokens": 6}).json()["room"] for p in prompts[:8]
        ]
        member = prefill.keys  # a member of the cluster, speaking out of turn
        senders = [CurveKeys.generate(), member]
        blasters = [
            threading.Thread(
                target=blast, args=(s.zmq_port, s.keys.public, keys, seed * 2 + i, FRAMES_PER_PORT // 2)
            )
            for seed, s in enumerate(targets)
            for i, keys in enumerate(senders)
        ]
        for t in blasters:
            t.start()
        rooms += [
            client.post("/rooms", json={"prompt": p, "max_new_tokens": 6}).json()["room"] for p in prompts[8:]
        ]
        for t in blasters:
            t.join(120)
            assert not t.is_alive()
        for service in targets:
            until(
                lambda s=service: metric(s, "kvroom_messages_received_total") >= FRAMES_PER_PORT,
                120,
                f"{service.name} to read every frame",
            )
            assert service.running
            assert metric(service, "kvroom_messages_rejected_total", 'kind="internal"') == 0
            # Well-formed messages from the wrong key were read and refused.
            assert metric(service, "kvroom_messages_rejected_total", 'kind="unauthorized"') > 0, service.name
        for prompt, room in zip(prompts, rooms, strict=True):
            final = client.get(f"/rooms/{room}", params={"wait": 60}).json()
            assert final["state"] == "SUCCESS", final
            assert final["output_ids"] == generate(model, encode_text(prompt), 6)
        until(lambda: pools_full(prefill, decode), 10, "pools back to full")
        assert client.get("/health").json()["status"] == "ok"
