import asyncio

import zmq
import zmq.asyncio

from shared.zmq_io import PushSockets, bind_pull


def test_sends_reach_a_pull_socket_and_bad_endpoints_fail_cleanly():
    async def run():
        ctx = zmq.asyncio.Context()
        pull = bind_pull(ctx, "tcp://127.0.0.1:*")
        endpoint = pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        push = PushSockets(ctx, max_sockets=2)
        try:
            assert push.send(endpoint, [b"a", b"b"])
            assert await asyncio.wait_for(pull.recv_multipart(), 5) == [b"a", b"b"]
            assert not push.send("not an endpoint", [b"x"])
            for port in range(1, 6):  # peers can name endpoints: the cache stays bounded
                push.send(f"tcp://127.0.0.1:{port}", [b"x"])
            assert len(push._sockets) == 2
        finally:
            push.close()
            pull.close(0)
            ctx.term()

    asyncio.run(run())
