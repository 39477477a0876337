"""A node's leader socket that takes rooms and never answers: real CURVE-serving ZMQ."""

import zmq

from shared.wire import protocol
from shared.wire.security import CurveKeys, Security
from tests.unit.bootstrap.test_api import AUTH, registration


class SilentNode:
    """A node's leader socket: it takes every message and answers none."""

    def __init__(self, context: zmq.Context):
        self.keys = CurveKeys.generate()
        self.sock = context.socket(zmq.PULL)
        Security(self.keys).server(self.sock)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def registration(self, node_id: str, role: str) -> dict:
        reg = registration(node_id, role, port=self.port)
        reg["ranks"][0]["public_key"] = self.keys.public
        return reg

    def messages(self, until: type, timeout_ms: int = 10_000) -> list:
        """What came, each assignment and abort on its own, up to one of type ``until``."""
        got: list = []
        while not any(isinstance(m, until) for m in got):
            assert self.sock.poll(timeout_ms), f"no {until.__name__} came; got {got}"
            batch = protocol.decode(self.sock.recv_multipart())[0]
            assert isinstance(batch, protocol.Assignments)
            got += [*batch.prefill_rooms, *batch.decode_rooms, *batch.aborts]
        return got


def join(client, prefill: SilentNode, decode: SilentNode) -> None:
    for node, (node_id, role) in ((prefill, ("p0", "prefill")), (decode, ("d0", "decode"))):
        joined = client.post("/nodes", json=node.registration(node_id, role), headers=AUTH)
        assert joined.status_code == 201
