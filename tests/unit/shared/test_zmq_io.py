"""ZMQ for the services: PUSH sockets that never block, a PULL socket drained on the loop, CURVE
senders known by their key, and the dispatcher that decodes and counts what it drops."""

import asyncio
import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import zmq

from shared.errors import RejectedMessage
from shared.metrics import ServiceMetrics
from shared.wire import protocol
from shared.wire.security import CurveKeys, Security, ZapHandler
from shared.wire.zmq_io import RECEIVE_BATCH, PushSockets, bind_pull, dispatcher, receive_forever

PLAIN = Security(None)
WAIT_S = 5.0  # the longest any test waits for something that must happen


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@contextlib.contextmanager
def sockets(
    ctx: zmq.Context, endpoint: str, max_sockets: int = 8, security: Security = PLAIN
) -> Iterator[tuple[zmq.Socket, PushSockets, str]]:
    """A bound PULL socket, PUSH sockets to send with, and the endpoint they reach it at."""
    pull = bind_pull(ctx, endpoint, security)
    push = PushSockets(ctx, PLAIN, max_sockets=max_sockets)
    try:
        yield pull, push, pull.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        push.close()
        pull.close(0)


class Inbox:
    """What a handler was given, and a bounded wait for it to be given enough."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self._changed = asyncio.Event()

    def put(self, item: Any) -> None:
        self.items.append(item)
        self._changed.set()

    async def until(self, done: Callable[[list[Any]], bool], timeout: float = WAIT_S) -> None:
        async with asyncio.timeout(timeout):
            while not done(self.items):
                self._changed.clear()
                await self._changed.wait()


@contextlib.asynccontextmanager
async def receiving(
    sock: zmq.Socket, on_message: Callable[..., object], **kwargs: Any
) -> AsyncIterator[None]:
    task = asyncio.create_task(receive_forever(sock, on_message, **kwargs))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_sends_reach_a_pull_socket_and_bad_endpoints_fail_cleanly(context):
    async def run() -> None:
        with sockets(context, "tcp://127.0.0.1:*", max_sockets=2) as (pull, push, endpoint):
            inbox = Inbox()
            async with receiving(pull, lambda frames, sender: inbox.put((frames, sender))):
                assert push.send(endpoint, "", [b"a", b"b"])
                await inbox.until(lambda items: len(items) == 1)
                assert inbox.items == [([b"a", b"b"], None)]  # no CURVE: no sender
                assert not push.send("not an endpoint", "", [b"x"])
                for port in range(1, 6):  # peers can name endpoints: the cache stays bounded
                    push.send(f"tcp://127.0.0.1:{port}", "", [b"x"])
                assert len(push._sockets) == 2
                push.forget("tcp://127.0.0.1:5")
                assert len(push._sockets) == 1

    asyncio.run(run())


def test_a_burst_is_received_whole_and_in_order_without_starving_the_loop(context):
    async def run() -> None:
        # inproc: a send returns with the message already in the queue
        with sockets(context, "inproc://burst") as (pull, push, endpoint):
            count = 600
            assert count > RECEIVE_BATCH
            for i in range(count):  # all queued before anyone watches the socket
                assert push.send(endpoint, "", [str(i).encode()])
            events: list[int | str] = []  # message numbers, and "tick" whenever other work ran
            inbox = Inbox()

            def on_message(frames: list[bytes], sender: str | None) -> None:
                events.append(int(frames[0]))
                inbox.put(frames)

            async def other_work() -> None:
                while True:
                    events.append("tick")
                    await asyncio.sleep(0)

            other = asyncio.create_task(other_work())
            try:
                async with receiving(pull, on_message):
                    await inbox.until(lambda items: len(items) == count)
            finally:
                other.cancel()
            assert [e for e in events if e != "tick"] == list(range(count))
            first, last = events.index(0), events.index(count - 1)
            assert "tick" in events[first:last]  # the burst did not hold the loop to itself

    asyncio.run(run())


def test_a_handler_that_raises_is_logged_and_loses_no_later_message(context, caplog):
    async def run() -> list[int]:
        with sockets(context, "inproc://raising") as (pull, push, endpoint):
            for i in range(5):
                assert push.send(endpoint, "", [str(i).encode()])
            inbox = Inbox()

            def handler(frames: list[bytes], sender: str | None) -> None:
                inbox.put(int(frames[0]))
                if len(inbox.items) == 2:
                    raise RuntimeError("a handler bug")

            async with receiving(pull, handler):
                await inbox.until(lambda items: len(items) == 5)
            return inbox.items

    with caplog.at_level(logging.ERROR, logger="shared.wire.zmq_io"):
        assert asyncio.run(run()) == [0, 1, 2, 3, 4]
    assert [r.getMessage() for r in caplog.records if r.name == "shared.wire.zmq_io"] == [
        "message handler failed; receiving goes on"
    ]


def test_urgent_messages_go_first_among_those_waiting_and_the_rest_keep_their_order(context):
    async def run() -> None:
        with sockets(context, "inproc://urgent") as (pull, push, endpoint):
            for i in range(10):  # all waiting before the receiver starts
                assert push.send(endpoint, "", [str(i).encode()])
            inbox = Inbox()
            async with receiving(
                pull, lambda f, sender: inbox.put(int(f[0])), urgent=lambda f: int(f[0]) % 3 == 0
            ):
                await inbox.until(lambda items: len(items) == 10)
                assert inbox.items == [0, 3, 6, 9, 1, 2, 4, 5, 7, 8]
                assert push.send(endpoint, "", [b"10"])  # and the socket is still watched
                await inbox.until(lambda items: len(items) == 11)
                assert inbox.items[-1] == 10

    asyncio.run(run())


@pytest.fixture
def curve_server(context) -> Iterator[tuple[zmq.Socket, str, CurveKeys]]:
    """A CURVE PULL socket with the context's ZAP handler: (socket, endpoint, the server's keys)."""
    zap = ZapHandler(context)
    keys = CurveKeys.generate()
    pull = bind_pull(context, "tcp://127.0.0.1:*", Security(keys))
    try:
        yield pull, pull.getsockopt_string(zmq.LAST_ENDPOINT), keys
    finally:
        pull.close(0)
        zap.close()


@contextlib.contextmanager
def pushing(context: zmq.Context, security: Security) -> Iterator[PushSockets]:
    push = PushSockets(context, security)
    try:
        yield push
    finally:
        push.close()


def test_a_curve_sender_is_known_by_its_key_and_others_never_get_through(context, curve_server):
    """Of three clients only the one with keys that knows the server's key is heard, as that key."""
    pull, endpoint, server = curve_server
    client = CurveKeys.generate()

    async def run() -> list[tuple[bytes, str | None]]:
        inbox = Inbox()
        with (
            pushing(context, PLAIN) as plain,
            pushing(context, Security(CurveKeys.generate())) as wrong_server,
            pushing(context, Security(client)) as member,
        ):
            async with receiving(pull, lambda frames, sender: inbox.put((frames[0].bytes, sender))):
                assert plain.send(endpoint, "", [b"plain"])
                assert wrong_server.send(endpoint, CurveKeys.generate().public, [b"wrong server key"])
                assert member.send(endpoint, server.public, [b"member"])
                await inbox.until(lambda items: len(items) >= 1)
                with pytest.raises(TimeoutError):  # the others stay out, however long they try
                    await inbox.until(lambda items: len(items) >= 2, timeout=0.5)
        return inbox.items

    assert asyncio.run(run()) == [(b"member", client.public)]


def test_a_curve_send_to_a_peer_without_a_key_is_refused_not_raised(context):
    with pushing(context, Security(CurveKeys.generate())) as push:
        assert not push.send("tcp://127.0.0.1:9", "", [b"x"])


def test_the_dispatcher_counts_what_it_drops_over_curve(context, curve_server):
    pull, endpoint, server = curve_server
    client = CurveKeys.generate()
    metrics = ServiceMetrics("test")
    abort = protocol.AbortRoom(transfer=5, rank=0, reason="aborted")

    async def run() -> list[tuple[protocol.Message, str | None]]:
        inbox = Inbox()
        handler = dispatcher(lambda msg, aux, sender: inbox.put((msg, sender)), metrics)
        with pushing(context, Security(client)) as push:
            async with receiving(pull, handler):
                assert push.send(endpoint, server.public, [b"garbage"])
                assert push.send(endpoint, server.public, [header(protocol.PROTOCOL_VERSION + 1), b"\x80"])
                assert push.send(endpoint, server.public, protocol.encode(abort))
                await inbox.until(lambda items: len(items) == 1)  # one connection: in order
        return inbox.items

    assert asyncio.run(run()) == [(abort, client.public)]
    assert rejected(metrics, "malformed") == 1 and rejected(metrics, "version") == 1
    assert received(metrics) == 3


def header(version: int = protocol.PROTOCOL_VERSION, kind: int = protocol.Kind.ABORT_ROOM) -> bytes:
    return protocol.MAGIC + struct.pack("!HB", version, kind)


def rejected(metrics: ServiceMetrics, kind: str) -> float:
    return metrics.registry.get_sample_value("kvroom_messages_rejected_total", {"kind": kind}) or 0.0


def received(metrics: ServiceMetrics) -> float:
    return metrics.registry.get_sample_value("kvroom_messages_received_total") or 0.0


DONE = protocol.DoneAux(
    transfer=5, rank=0, prefill_rank=0, aux_slot=1, pages_written=1, bytes_written=8, completed_at=1.0
)


def test_the_dispatcher_hands_on_what_decodes():
    calls: list[tuple[protocol.Message, bytes | None, str | None]] = []
    metrics = ServiceMetrics("test")
    on_message = dispatcher(
        lambda m, aux, s: calls.append((m, None if aux is None else bytes(aux), s)), metrics
    )
    on_message(protocol.encode(DONE, b"aux"), "key")
    on_message(protocol.encode(protocol.TransferStarted(transfer=5, rank=0, prefill_rank=0)), None)
    assert calls == [
        (DONE, b"aux", "key"),
        (protocol.TransferStarted(transfer=5, rank=0, prefill_rank=0), None, None),
    ]
    assert received(metrics) == 2
    assert metrics.registry.get_sample_value("kvroom_messages_rejected_total", {"kind": "malformed"}) is None


@pytest.mark.parametrize(
    ("frames", "kind"),
    [
        ([b"garbage"], "malformed"),
        ([header(protocol.PROTOCOL_VERSION - 1), b"\x80"], "version"),
        ([header(kind=0x63), b"\x80"], "unknown_type"),
        ([header(), b"\x00" * (protocol.MAX_BODY_BYTES + 1)], "oversized"),
    ],
)
def test_the_dispatcher_counts_frames_that_do_not_decode_by_kind(frames, kind):
    metrics = ServiceMetrics("test")
    calls: list[object] = []
    dispatcher(lambda *a: calls.append(a), metrics)(frames, None)
    assert calls == [] and rejected(metrics, kind) == 1 and received(metrics) == 1


def test_the_dispatcher_counts_refusals_by_their_kind_and_bugs_as_internal(caplog):
    metrics = ServiceMetrics("test")

    def handle(msg: protocol.Message, aux: memoryview | None, sender: str | None) -> None:
        if isinstance(msg, protocol.AbortRoom):
            raise RejectedMessage("no such room", room=msg.transfer, kind="unknown_room")
        raise RuntimeError("a handler bug")

    on_message = dispatcher(handle, metrics)
    with caplog.at_level(logging.WARNING, logger="shared.wire.zmq_io"):
        on_message(protocol.encode(protocol.AbortRoom(transfer=9, rank=0, reason="x")), None)
        on_message(protocol.encode(protocol.TransferStarted(transfer=5, rank=0, prefill_rank=0)), None)
    assert rejected(metrics, "unknown_room") == 1 and rejected(metrics, "internal") == 1
    assert any("room=9" in r.getMessage() and "unknown_room" in r.getMessage() for r in caplog.records)


def test_a_dropped_frame_is_logged_with_the_room_it_names(caplog):
    metrics = ServiceMetrics("test")
    body = protocol.encode(protocol.AbortRoom(transfer=31, rank=0, reason="x"))[1]
    bad_rank = [header(), body.replace(b"\xa4rank\x00", b"\xa4rank\xcd\x03\xe7")]
    with caplog.at_level(logging.WARNING, logger="shared.wire.zmq_io"):
        dispatcher(lambda *a: None, metrics)(bad_rank, None)
    assert rejected(metrics, "malformed") == 1
    assert [r.getMessage().split(" ")[0] for r in caplog.records] == ["room=31"]
