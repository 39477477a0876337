"""The kernel's word on a closed writer's bytes, over real loopback sockets: a writer that closed
with bytes its peer has not taken is still sending, and a reader that has not read what came
before the FIN has bytes still to land."""

import asyncio
import socket
from collections.abc import Iterator

import pytest

from shared.kv import tcp_drain
from tests.support.sockets import SMALL, loopback_connection
from tests.support.waiting import until


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    with loopback_connection() as connection:
        yield connection


def ends(port: int) -> tuple[tcp_drain.Connection, tcp_drain.Connection]:
    """The writer's end and the reader's end of the one connection to ``port``."""
    found = {
        c.local_port == port: c for c in tcp_drain.connections() if port in (c.local_port, c.remote_port)
    }
    return found[False], found[True]


def fill(writer: socket.socket) -> int:
    writer.setblocking(False)
    sent = 0
    with pytest.raises(BlockingIOError):
        while True:
            sent += writer.send(b"k" * SMALL)
    return sent


def test_a_closed_writer_whose_bytes_back_up_is_still_sending_until_its_reader_takes_them(pair):
    writer, reader, port = pair
    sent = fill(writer)
    writer.close()  # as its process's exit would: the kernel holds what is left
    sending, receiving = ends(port)
    assert sending.inode == 0 and sending.orphan_still_sending
    assert not receiving.unread_after_close  # no FIN has reached it yet
    assert not tcp_drain.dead_writes_sent()
    got = 0
    while got < sent - 100:
        got += len(reader.recv(min(1000, sent - 100 - got)))
    until(lambda: not ends(port)[0].orphan_still_sending, timeout=5, what="the FIN acknowledged")
    assert ends(port)[1].unread_after_close  # 100 bytes before the FIN are still unread
    assert not tcp_drain.closed_writes_read()
    while got < sent:
        got += len(reader.recv(sent - got))
    assert not ends(port)[1].unread_after_close
    assert tcp_drain.closed_writes_read()


def test_a_reader_that_took_every_byte_has_nothing_to_land_and_an_open_connection_is_no_closed_one(pair):
    writer, reader, port = pair
    writer.sendall(b"k" * 100)
    until(lambda: ends(port)[1].rx_queue == 100, timeout=5, what="the bytes in the reader's queue")
    assert not ends(port)[1].unread_after_close  # unread, but its writer may still be alive
    assert not ends(port)[0].orphan_still_sending  # held by this process, and acknowledged
    writer.close()
    until(lambda: ends(port)[1].unread_after_close, timeout=5, what="the FIN")
    assert reader.recv(200) == b"k" * 100
    assert not ends(port)[1].unread_after_close
    assert reader.recv(200) == b""


def test_what_waits_for_its_writers_bytes_is_handed_on_once_they_are_read_and_dropped_once_it_no_longer_waits(
    pair,
):
    writer, reader, _ = pair
    writer.sendall(b"k" * 100)
    writer.close()  # a gone writer's 100 bytes and its FIN wait in this process
    until(lambda: not tcp_drain.closed_writes_read(), what="the FIN")
    loop = asyncio.new_event_loop()
    landed: list[list[str]] = []
    waiting = {"kept", "dropped"}
    after = tcp_drain.AfterLanding(loop, True, lambda item: item in waiting, landed.append)
    try:
        after.add("kept")
        after.add("dropped")
        loop.run_until_complete(asyncio.sleep(0.1))  # ten looks: the bytes are unread
        assert landed == []
        waiting.discard("dropped")  # its fence ended meanwhile
        assert reader.recv(200) == b"k" * 100
        loop.run_until_complete(asyncio.sleep(0.1))
        assert landed == [["kept"]]
        # What no longer waits when it comes is dropped at once: no look is left scheduled.
        waiting.clear()
        after.add("late")
        assert not loop._scheduled  # type: ignore[attr-defined]
    finally:
        loop.close()
