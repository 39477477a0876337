"""Two bare ZMQ messages between two processes: the least a room's two messages cost.

A room needs two messages between the nodes, the transfer request and done+aux.
Here one process sends a message of the same size to another over CURVE on
127.0.0.1, as the nodes do, and the other answers the moment it arrives: no
event loop, no decoding, no write. Timed in turn with the rooms, so both meet
the host in the same state.
"""

import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import zmq

# A transfer request and a done+aux with the default aux fields are a few hundred bytes.
MESSAGE_BYTES = 512


def _curve_server(sock: zmq.Socket, keys: tuple[bytes, bytes]) -> None:
    sock.curve_server = True
    sock.curve_publickey, sock.curve_secretkey = keys


def _curve_client(sock: zmq.Socket, keys: tuple[bytes, bytes], server_public: bytes) -> None:
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = keys


def _open(keys: tuple[bytes, bytes]) -> tuple[zmq.Context, zmq.Socket, int]:
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    _curve_server(pull, keys)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    return context, pull, port


def _push_to(context: zmq.Context, keys: tuple[bytes, bytes], peer: tuple[int, bytes]) -> zmq.Socket:
    push = context.socket(zmq.PUSH)
    push.linger = 0
    _curve_client(push, keys, peer[1])
    push.connect(f"tcp://127.0.0.1:{peer[0]}")
    return push


def _answerer(keys: tuple[bytes, bytes], conn: Connection) -> None:
    context, pull, port = _open(keys)
    conn.send(port)
    push = _push_to(context, keys, conn.recv())
    while (message := pull.recv()) != b"":
        push.send(message)
    push.close()
    pull.close(linger=0)
    context.term()


class ZmqPair:
    """This process and an answering one, each with a CURVE PULL socket and a PUSH to the other."""

    def __init__(self) -> None:
        keys = zmq.curve_keypair()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._answering = ctx.Process(target=_answerer, args=(keys, child), daemon=True)
        self._answering.start()
        self._context, self._pull, port = _open(keys)
        self._push = _push_to(self._context, keys, (self._conn.recv(), keys[0]))
        self._conn.send((port, keys[0]))
        self._message = bytes(MESSAGE_BYTES)
        self.round_trip()  # the CURVE handshakes, once

    def round_trip(self) -> float:
        """Seconds from sending a message until the answer arrived."""
        started = time.perf_counter()
        self._push.send(self._message)
        self._pull.recv()
        return time.perf_counter() - started

    def close(self) -> None:
        self._push.send(b"")
        self._answering.join(10)
        if self._answering.is_alive():
            self._answering.kill()
        self._push.close()
        self._pull.close(linger=0)
        self._context.term()
