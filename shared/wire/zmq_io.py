"""ZMQ for the services: one PUSH socket per peer endpoint with sends that never
block, and a PULL socket drained on the event loop.

With CURVE on (see ``shared.wire.security``) a PUSH socket is a client of the
peer's public key, a PULL socket a server, and every message received comes
with the sender's public key. Sockets are plain (not zmq.asyncio) sockets; a
PushSockets object belongs to one thread.
"""

import asyncio
import collections
import contextlib
import logging
from collections.abc import Callable
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from shared.errors import KvroomError, ProtocolError
from shared.metrics import ServiceMetrics
from shared.wire import protocol
from shared.wire.security import Security

log = logging.getLogger(__name__)

# A frame past this is dropped by ZMQ itself, before Python sees it.
MAX_MESSAGE_BYTES = 4 << 20
SEND_HWM = 100_000
# Endpoints come from peers; keep a bounded number of sockets open, least recently used out.
MAX_PEER_SOCKETS = 256

Handler = Callable[[protocol.Message, memoryview | None, str | None], None]


class PushSockets:
    def __init__(self, context: zmq.Context, security: Security, max_sockets: int = MAX_PEER_SOCKETS):
        self._context = context
        self._security = security
        self._sockets: collections.OrderedDict[tuple[str, str], zmq.Socket] = collections.OrderedDict()
        self._max = max_sockets
        # Per watched endpoint: its socket, that socket's monitor, and the monitor's descriptor.
        self._monitors: dict[str, tuple[zmq.Socket, zmq.Socket, int]] = {}

    def _socket(self, endpoint: str, server_key: str) -> zmq.Socket:
        key = (endpoint, server_key)
        sock = self._sockets.get(key)
        if sock is not None:
            self._sockets.move_to_end(key)
            return sock
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        try:
            self._security.client(sock, server_key)
            sock.connect(endpoint)
        except (zmq.ZMQError, ValueError, KvroomError) as exc:
            sock.close(0)
            raise zmq.ZMQError(msg=f"cannot connect to {endpoint}: {exc}") from exc
        self._sockets[key] = sock
        if len(self._sockets) > self._max:
            _, oldest = self._sockets.popitem(last=False)
            oldest.close(0)
        return sock

    def send(self, endpoint: str, server_key: str, frames: list[bytes]) -> bool:
        """Queue a message to ``endpoint`` (whose CURVE key is ``server_key``); False if it could not."""
        try:
            # Copying sends: zero-copy pays a tracking thread per message, far more than
            # copying the few hundred bytes a control message has.
            self._socket(endpoint, server_key).send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not queue a message to %s: %s", endpoint, exc)
            return False
        return True

    def watch(self, endpoint: str, server_key: str, on_disconnect: Callable[[str], object]) -> None:
        """Connect to ``endpoint`` now and call ``on_disconnect(endpoint)`` from the event loop
        whenever that connection drops: a peer process that died is known at once."""
        try:
            sock = self._socket(endpoint, server_key)
        except zmq.ZMQError:
            return
        watched = self._monitors.get(endpoint)
        if watched is not None and watched[0] is sock:
            return
        # A peer back at this endpoint with another key has another socket: the old one's monitor
        # is closed here, or it stays open and zmq.Context.term() waits on it for ever.
        self._unwatch(endpoint)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        loop = asyncio.get_running_loop()

        def drain() -> None:
            while not monitor.closed:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    return
                except zmq.ZMQError:
                    break
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    on_disconnect(endpoint)
            loop.remove_reader(fd)

        fd = monitor.fileno()
        loop.add_reader(fd, drain)
        self._monitors[endpoint] = (sock, monitor, fd)

    def _unwatch(self, endpoint: str) -> None:
        watched = self._monitors.pop(endpoint, None)
        if watched is not None:
            _, monitor, fd = watched
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(fd)
            monitor.close(0)

    def forget(self, endpoint: str) -> None:
        self._unwatch(endpoint)
        for key in [k for k in self._sockets if k[0] == endpoint]:
            self._sockets.pop(key).close(0)

    def close(self) -> None:
        for endpoint in list(self._monitors):
            self._unwatch(endpoint)
        for sock in self._sockets.values():
            sock.close(0)
        self._sockets.clear()


# Messages taken in one turn of the event loop before other callbacks get theirs.
RECEIVE_BATCH = 256


def bind_pull(context: zmq.Context, endpoint: str, security: Security | None = None) -> zmq.Socket:
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    if security is not None:
        security.server(sock)
    sock.bind(endpoint)
    return sock


Received = tuple[list[Any], str | None]


async def receive_forever(
    sock: zmq.Socket,
    on_message: Callable[[list[Any], str | None], object],
    urgent: Callable[[list[Any]], bool] | None = None,
) -> None:
    """Hand each message that reaches ``sock`` to ``on_message(frames, sender)`` on the event loop.

    ``sender`` is the CURVE public key of the peer that sent it, or None on a
    socket without CURVE. The socket's descriptor is watched by the loop and
    drained with non-blocking receives: a third of the cost per message of
    zmq.asyncio, which makes a future for each. ZMQ signals the descriptor on
    edges only, so every wake-up drains the socket until it is empty, and a
    handler that raises is logged rather than allowed to end the drain:
    messages left behind would wait for the next one to arrive. Of the
    messages waiting at a wake-up, those ``urgent`` picks are handled first,
    the rest in arrival order. Runs until cancelled.
    """
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    authenticated = bool(sock.curve_server)

    def drain() -> None:
        if sock.closed:  # a drain scheduled before shutdown
            return
        batch: list[Received] = []
        # Asking for POLLIN, cheaper than reading until zmq.Again, also re-arms the edge.
        while len(batch) < RECEIVE_BATCH and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                if authenticated:
                    frames: list[Any] = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    batch.append((frames, frames[0].get("User-Id")))
                else:
                    batch.append((sock.recv_multipart(zmq.NOBLOCK), None))
            except zmq.Again:  # what was taken is still handled
                break
        if urgent is not None:
            batch.sort(key=lambda item: not urgent(item[0]))  # stable: otherwise arrival order
        for frames, sender in batch:
            try:
                on_message(frames, sender)
            except Exception:
                log.exception("message handler failed; receiving goes on")
        if len(batch) == RECEIVE_BATCH:
            loop.call_soon(drain)  # more may wait: continue after the loop's other work

    loop.add_reader(fd, drain)
    loop.call_soon(drain)  # messages that arrived before the watch began
    try:
        await loop.create_future()  # until cancelled
    finally:
        loop.remove_reader(fd)


def dispatcher(handle: Handler, metrics: ServiceMetrics) -> Callable[[list[Any], str | None], None]:
    """An ``on_message`` for receive_forever: decode each message and hand it to ``handle``.

    A message that does not decode, or that ``handle`` refuses with a
    ProtocolError, is counted by kind and logged with its room, then dropped.
    """

    def on_message(buffers: list[Any], sender: str | None) -> None:
        metrics.received.inc()
        try:
            msg, aux = protocol.decode(buffers)
            handle(msg, aux, sender)
        except ProtocolError as exc:
            room = getattr(exc, "room", None) or protocol.peek_transfer(buffers)
            metrics.rejected.labels(exc.kind).inc()
            log.warning("room=%s dropped message (%s): %s", room, exc.kind, exc, extra={"room": room})
        except Exception:
            metrics.rejected.labels("internal").inc()
            log.exception("message handler failed; the service keeps serving")

    return on_message
