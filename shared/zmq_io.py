"""Outbound ZMQ: one PUSH socket per peer endpoint, sends that never block.

Works with an asyncio context on an event loop or a plain context in a thread;
a PushSockets object belongs to one thread.
"""

import collections
import logging

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

# A frame past this is dropped by ZMQ itself, before Python sees it.
MAX_MESSAGE_BYTES = 4 << 20
SEND_HWM = 100_000
# Endpoints come from peers; keep a bounded number of sockets open, least recently used out.
MAX_PEER_SOCKETS = 256


class PushSockets:
    def __init__(self, context: zmq.Context, max_sockets: int = MAX_PEER_SOCKETS):
        self._context = context
        self._sockets: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()
        self._max = max_sockets

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._sockets.get(endpoint)
        if sock is not None:
            self._sockets.move_to_end(endpoint)
            return sock
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        self._sockets[endpoint] = sock
        if len(self._sockets) > self._max:
            _, oldest = self._sockets.popitem(last=False)
            oldest.close(0)
        return sock

    def send(self, endpoint: str, frames: list[bytes]) -> bool:
        """Queue a message to ``endpoint``; False if it could not be queued."""
        try:
            # Copying sends: zero-copy pays a tracking thread per message, far more than
            # copying the few hundred bytes a control message has.
            self._socket(endpoint).send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not queue a message to %s: %s", endpoint, exc)
            return False
        return True

    def forget(self, endpoint: str) -> None:
        sock = self._sockets.pop(endpoint, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()


def bind_pull(context: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.bind(endpoint)
    return sock
