"""A ZMQ hop between two services that can hold back chosen messages.

The service behind it advertises the proxy's port (``--advertise-zmq-port``),
so peers send through it without knowing.
"""

import threading
from collections.abc import Callable

import zmq

from shared import protocol
from launcher.local_stack import Service, free_port

Frames = list[bytes]


class HoldingProxy:
    def __init__(self, target_port: int, hold: Callable[[protocol.Message], bool]):
        self.port = free_port()
        self._target = f"tcp://127.0.0.1:{target_port}"
        self._hold = hold
        self.held: list[Frames] = []
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._inbound = self._ctx.socket(zmq.PULL)
        self._inbound.setsockopt(zmq.LINGER, 0)
        self._inbound.bind(f"tcp://127.0.0.1:{self.port}")
        self._outbound = self._ctx.socket(zmq.PUSH)
        self._outbound.setsockopt(zmq.LINGER, 0)
        self._outbound.connect(self._target)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._pending: list[Frames] = []

    def __enter__(self) -> "HoldingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._inbound.close(0)
        self._outbound.close(0)
        self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            for frames in pending:
                self._outbound.send_multipart(frames)
            if not self._inbound.poll(20):
                continue
            frames = self._inbound.recv_multipart()
            msg, _ = protocol.decode(frames)
            if self._hold(msg):
                with self._lock:
                    self.held.append(frames)
            else:
                self._outbound.send_multipart(frames)

    def inject(self, frames: Frames) -> None:
        """Send ``frames`` on to the target from the proxy's own thread."""
        with self._lock:
            self._pending.append(frames)

    def release(self, room: int | None = None) -> None:
        """Send on the held messages (only those of ``room`` if given)."""
        with self._lock:
            keep = []
            for frames in self.held:
                if room is None or protocol.decode(frames)[0].room == room:
                    self._pending.append(frames)
                else:
                    keep.append(frames)
            self.held = keep

    def held_for(self, room: int) -> Frames:
        with self._lock:
            return next(f for f in self.held if protocol.decode(f)[0].room == room)

    def drop(self, room: int) -> None:
        with self._lock:
            self.held = [f for f in self.held if protocol.decode(f)[0].room != room]

    def held_rooms(self) -> set[int]:
        with self._lock:
            return {protocol.decode(frames)[0].room for frames in self.held}


def in_front_of(service: Service, hold: Callable[[protocol.Message], bool]) -> HoldingProxy:
    """A proxy that ``service`` (not started yet) will advertise as its ZMQ endpoint."""
    proxy = HoldingProxy(service.zmq_port, hold)
    service.args += ["--advertise-zmq-port", str(proxy.port)]
    return proxy
