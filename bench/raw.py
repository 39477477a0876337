"""The raw Mooncake engine between two processes: the baseline kvroom is measured against."""

import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection

import torch

from shared.kv.transfer import MooncakeEngine


def _receiver(nbytes: int, conn: Connection) -> None:
    engine = MooncakeEngine("127.0.0.1", "tcp")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    engine.register(buf.data_ptr(), nbytes)
    conn.send((engine.session_id, buf.data_ptr()))
    conn.recv()  # hold the buffer until told to stop


def _sender(nbytes: int, peer: tuple[str, int], conn: Connection) -> None:
    session, dst_base = peer
    engine = MooncakeEngine("127.0.0.1", "tcp")
    buf = torch.ones(nbytes, dtype=torch.uint8)
    engine.register(buf.data_ptr(), nbytes)
    src_base = buf.data_ptr()
    while True:
        job = conn.recv()
        if job is None:
            return
        total, entries, polled = job
        size = total // entries
        writes = [(src_base + i * size, dst_base + i * size, size) for i in range(entries)]
        write = engine.write_polled if polled else engine.write_blocking
        started = time.perf_counter()
        write(session, writes)
        conn.send(time.perf_counter() - started)


class RawPair:
    """A sender and a receiver process, each with its own engine, on 127.0.0.1 over TCP."""

    def __init__(self, nbytes: int):
        os.environ["MC_FORCE_TCP"] = "1"
        ctx = mp.get_context("spawn")
        self._recv_conn, child = ctx.Pipe()
        self._receiver = ctx.Process(target=_receiver, args=(nbytes, child), daemon=True)
        self._receiver.start()
        peer = self._recv_conn.recv()
        self._send_conn, child = ctx.Pipe()
        self._sender = ctx.Process(target=_sender, args=(nbytes, peer, child), daemon=True)
        self._sender.start()
        self.pids = [self._receiver.pid, self._sender.pid]
        self.nbytes = nbytes

    def write(self, total: int, entries: int = 1, polled: bool = False) -> float:
        """Seconds to write ``total`` bytes in ``entries`` pieces.

        By default with the engine's blocking batch call (batch_transfer_sync_write);
        ``polled`` submits and polls the way kvroom's nodes do over TCP.
        """
        if total > self.nbytes:
            raise ValueError(f"{total} bytes do not fit the {self.nbytes} registered")
        self._send_conn.send((total, entries, polled))
        seconds: float = self._send_conn.recv()
        return seconds

    def close(self) -> None:
        self._send_conn.send(None)
        self._recv_conn.send(None)
        for proc in (self._sender, self._receiver):
            proc.join(10)
            if proc.is_alive():
                proc.kill()
