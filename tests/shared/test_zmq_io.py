import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import zmq

from shared.zmq_io import RECEIVE_BATCH, PushSockets, bind_pull, receive_forever


@contextlib.contextmanager
def sockets(endpoint: str, max_sockets: int = 8) -> Iterator[tuple[zmq.Socket, PushSockets, str]]:
    """A bound PULL socket, PUSH sockets to send with, and the endpoint they reach it at."""
    ctx = zmq.Context()
    pull = bind_pull(ctx, endpoint)
    push = PushSockets(ctx, max_sockets=max_sockets)
    try:
        yield pull, push, pull.getsockopt(zmq.LAST_ENDPOINT).decode()
    finally:
        push.close()
        pull.close(0)
        ctx.term()


async def until(done: Callable[[], bool]) -> None:
    """Let the loop run until ``done()``, for at most five seconds."""
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)


def test_sends_reach_a_pull_socket_and_bad_endpoints_fail_cleanly():
    async def run():
        with sockets("tcp://127.0.0.1:*", max_sockets=2) as (pull, push, endpoint):
            received: list[list[bytes]] = []
            receiver = asyncio.create_task(receive_forever(pull, received.append))
            try:
                assert push.send(endpoint, [b"a", b"b"])
                await until(lambda: bool(received))
                assert received == [[b"a", b"b"]]
                assert not push.send("not an endpoint", [b"x"])
                for port in range(1, 6):  # peers can name endpoints: the cache stays bounded
                    push.send(f"tcp://127.0.0.1:{port}", [b"x"])
                assert len(push._sockets) == 2
            finally:
                receiver.cancel()

    asyncio.run(run())


def test_a_burst_is_received_whole_and_in_order_without_starving_the_loop():
    async def run():
        # inproc: a send returns with the message already in the queue
        with sockets("inproc://burst") as (pull, push, endpoint):
            count = 600
            assert count > RECEIVE_BATCH
            for i in range(count):  # all queued before anyone watches the socket
                assert push.send(endpoint, [str(i).encode()])
            events: list[int | str] = []  # message numbers, and "tick" whenever other work ran

            async def other_work() -> None:
                while True:
                    events.append("tick")
                    await asyncio.sleep(0)

            receiver = asyncio.create_task(receive_forever(pull, lambda f: events.append(int(f[0]))))
            other = asyncio.create_task(other_work())
            try:
                await until(lambda: bool(events.count("tick")) and count - 1 in events)
                received = [e for e in events if e != "tick"]
                assert received == list(range(count))
                first, last = events.index(0), events.index(count - 1)
                assert "tick" in events[first:last]  # the burst did not hold the loop to itself
            finally:
                receiver.cancel()
                other.cancel()

    asyncio.run(run())


def test_a_handler_that_raises_is_logged_and_loses_no_later_message(caplog):
    async def run():
        with sockets("inproc://raising") as (pull, push, endpoint):
            for i in range(5):
                assert push.send(endpoint, [str(i).encode()])
            received: list[int] = []

            def handler(frames: list[bytes]) -> None:
                received.append(int(frames[0]))
                if len(received) == 2:
                    raise RuntimeError("a handler bug")

            receiver = asyncio.create_task(receive_forever(pull, handler))
            try:
                await until(lambda: len(received) == 5)
                assert received == [0, 1, 2, 3, 4]
            finally:
                receiver.cancel()

    with caplog.at_level(logging.ERROR, logger="shared.zmq_io"):
        asyncio.run(run())
    assert [r.getMessage() for r in caplog.records if r.name == "shared.zmq_io"] == [
        "message handler failed; receiving goes on"
    ]


def test_urgent_messages_go_first_among_those_waiting_and_the_rest_keep_their_order():
    async def run():
        with sockets("inproc://urgent") as (pull, push, endpoint):
            for i in range(10):  # all waiting before the receiver starts
                assert push.send(endpoint, [str(i).encode()])
            received: list[int] = []
            receiver = asyncio.create_task(
                receive_forever(
                    pull, lambda f: received.append(int(f[0])), urgent=lambda f: int(f[0]) % 3 == 0
                )
            )
            try:
                await until(lambda: len(received) == 10)
                assert received == [0, 3, 6, 9, 1, 2, 4, 5, 7, 8]
                assert push.send(endpoint, [b"10"])  # and the socket is still watched
                await until(lambda: len(received) == 11)
                assert received[-1] == 10
            finally:
                receiver.cancel()

    asyncio.run(run())
