"""A real loopback TCP connection with small kernel buffers, so that a writer's bytes back up."""

import contextlib
import socket
from collections.abc import Iterator

SMALL = 4096


@contextlib.contextmanager
def loopback_connection() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """(writer, reader, the reader's port)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    writer = socket.socket()
    writer.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL)
    try:
        writer.connect(("127.0.0.1", port))
        reader, _ = server.accept()
    finally:
        server.close()
    try:
        yield writer, reader, port
    finally:
        writer.close()
        reader.close()
