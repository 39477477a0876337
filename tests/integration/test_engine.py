"""The Mooncake engine wrapper against a real engine in another process, over TCP on 127.0.0.1."""

import multiprocessing as mp
from collections.abc import Iterator
from multiprocessing.connection import Connection

import pytest
import torch

from shared.errors import TransferError
from shared.kv.transfer import MAX_IN_FLIGHT, MooncakeEngine, WriteJob

REGION = 4 << 20


def _receiver(conn: Connection) -> None:
    engine = MooncakeEngine("127.0.0.1", "tcp")
    buf = torch.zeros(REGION, dtype=torch.uint8)
    engine.register(buf.data_ptr(), REGION)
    conn.send((engine.session_id, buf.data_ptr()))
    while (offset := conn.recv()) is not None:
        conn.send(bytes(buf[offset : offset + 4096].numpy()))


class Peer:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_receiver, args=(child,), daemon=True)
        self.process.start()
        assert self.conn.poll(60), "the receiving engine did not start"
        self.session, self.base = self.conn.recv()

    def page(self, offset: int) -> bytes:
        """The 4 KiB at ``offset`` of the peer's region."""
        self.conn.send(offset)
        data: bytes = self.conn.recv()
        return data

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def sender() -> Iterator[tuple[MooncakeEngine, torch.Tensor]]:
    engine = MooncakeEngine("127.0.0.1", "tcp")
    source = (torch.arange(REGION, dtype=torch.int64) % 251).to(torch.uint8)
    engine.register(source.data_ptr(), REGION)
    yield engine, source
    engine.close()


@pytest.fixture
def peer() -> Iterator[Peer]:
    p = Peer()
    yield p
    p.stop()


def expected(source: torch.Tensor, offset: int) -> bytes:
    return bytes(source[offset : offset + 4096].numpy())


@pytest.mark.parametrize("method", ["write_polled", "write_blocking"])
def test_scattered_writes_land_every_byte(sender, peer, method):
    engine, source = sender
    # More pieces than may be in flight at once, each to a page of its own, every other page.
    count = MAX_IN_FLIGHT + 44
    writes = [(source.data_ptr() + i * 4096, peer.base + 2 * i * 4096, 4096) for i in range(count)]
    assert getattr(engine, method)(peer.session, writes) == count * 4096
    for i in (0, 1, MAX_IN_FLIGHT, count - 1):
        assert peer.page(2 * i * 4096) == expected(source, i * 4096)
    assert peer.page(4096) == bytes(4096)  # the gaps stay untouched


def test_a_write_outside_the_peers_memory_fails_and_later_writes_land(sender, peer):
    engine, source = sender
    good = (source.data_ptr(), peer.base, 4096)
    past_the_end = (source.data_ptr(), peer.base + REGION - 100, 4096)
    with pytest.raises(TransferError):
        engine.write_polled(peer.session, [good, past_the_end, good])
    assert engine.write_polled(peer.session, [(source.data_ptr() + 4096, peer.base + 8192, 4096)]) == 4096
    assert peer.page(8192) == expected(source, 4096)


def test_a_write_to_a_peer_that_died_fails(sender, peer):
    engine, source = sender
    assert engine.write_polled(peer.session, [(source.data_ptr(), peer.base, 4096)]) == 4096
    peer.process.kill()
    peer.process.join(10)
    with pytest.raises(TransferError):
        engine.write_polled(peer.session, [(source.data_ptr(), peer.base, 1 << 20)])


def test_jobs_written_together_land_and_one_that_fails_fails_alone(sender, peer):
    engine, source = sender
    src = source.data_ptr()
    jobs = [
        WriteJob(peer.session, [(src + 4096, peer.base + 4096, 4096), (src + 8192, peer.base + 8192, 4096)]),
        WriteJob(peer.session, [(src, peer.base + REGION - 100, 4096)]),  # past the peer's end
        WriteJob(peer.session, [(src + 3 * 4096, peer.base + 3 * 4096, 1 << 20)]),
    ]
    first, failed, third = engine.write_together(jobs)
    assert (first, third) == (8192, 1 << 20)
    assert isinstance(failed, TransferError)
    for offset in (4096, 8192, 3 * 4096, 3 * 4096 + (1 << 20) - 4096):
        assert peer.page(offset) == expected(source, offset)
