"""The bootstrap's sockets to its nodes' leaders close with it, however often a node came back:
``zmq.Context.term()`` at shutdown waits for ever on any socket left open."""

import asyncio
import threading

import zmq

from shared.wire.security import CurveKeys, Security, ZapHandler
from shared.wire.zmq_io import PushSockets


def terminates(context: zmq.Context, seconds: float = 10.0) -> bool:
    done = threading.Event()

    def term() -> None:
        context.term()
        done.set()

    threading.Thread(target=term, daemon=True).start()
    return done.wait(seconds)


def test_a_node_back_at_its_address_with_another_key_leaves_no_socket_open():
    context = zmq.Context()
    zap = ZapHandler(context)
    leader = context.socket(zmq.PULL)
    try:
        first, second = CurveKeys.generate(), CurveKeys.generate()
        Security(first).server(leader)
        endpoint = f"tcp://127.0.0.1:{leader.bind_to_random_port('tcp://127.0.0.1')}"
    finally:
        leader.close(0)

    async def watch_both() -> bool:
        push = PushSockets(context, Security(CurveKeys.generate()))
        push.watch(endpoint, first.public, print)
        push.watch(endpoint, first.public, print)  # the same node registering again
        push.watch(endpoint, second.public, print)  # the node restarted with a new key
        push.send(endpoint, second.public, [b"assignments"])
        push.close()
        zap.close()
        return terminates(context)  # on the running loop, as the bootstrap's close does

    assert asyncio.run(watch_both()), "a socket was left open"
