"""A ZMQ hop in front of a service that can hold back, change or inject chosen messages.

The service behind it advertises the proxy's ports (``--advertise-zmq-port``),
so peers send through it without knowing. On a secure stack the proxy speaks
CURVE with the service's own key pair, sees who sent each message, and passes
it on under that sender's key: the service sees the true sender, as it would
without the proxy. It covers every rank of the service: rank r on the proxy's
port + r.
"""

import threading
from collections.abc import Callable
from pathlib import Path

import zmq

from launcher.local_stack import Service, free_ports
from shared.wire import protocol
from shared.wire.security import CurveKeys, Security, ZapHandler

Frames = list[bytes]
Hold = Callable[[protocol.Message], bool]  # messages name the rank they are for


def stack_keys(key_dir: Path | None) -> dict[str, CurveKeys]:
    """Every key pair a LocalStack wrote, by public key."""
    if key_dir is None or not key_dir.exists():
        return {}
    pairs = [CurveKeys.load(path) for path in key_dir.glob("*.key_secret")]
    return {pair.public: pair for pair in pairs}


def singles(frames: Frames) -> list[Frames]:
    """A batch of transfer requests as the single messages it stands for (which the prefill
    takes as well), so that each request is held or passed on its own."""
    msg, _ = protocol.decode(frames)
    if isinstance(msg, protocol.TransferRequests):
        return [protocol.encode(request) for request in msg.requests]
    return [frames]


class HoldingProxy:
    def __init__(self, target: Service, hold: Hold, ranks: int = 1):
        self.port = free_ports(ranks)
        self._target_port = target.zmq_port
        self._hold = hold
        self._ctx = zmq.Context()
        self._key_dir = target.key_file.parent if target.key_file else None
        own = target.keys if target.key_file else None
        self._zap = ZapHandler(self._ctx) if own else None
        self._security = Security(own)
        self._inbound = []
        for r in range(ranks):
            sock = self._ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            self._security.server(sock)
            sock.bind(f"tcp://127.0.0.1:{self.port + r}")
            self._inbound.append(sock)
        self._outbound: dict[tuple[int, str], zmq.Socket] = {}
        self.held: list[tuple[int, str, Frames]] = []  # (rank, sender key, frames)
        self.passed: list[tuple[int, protocol.Message]] = []
        self._lock = threading.Lock()
        self._pending: list[tuple[int, str, Frames]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HoldingProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        if self._zap is not None:
            self._zap.close()
        self._ctx.destroy(linger=0)

    def _out(self, rank: int, sender: str) -> zmq.Socket:
        """A socket to the service's rank under ``sender``'s own key pair."""
        sock = self._outbound.get((rank, sender))
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            if self._security.keys is not None:
                # Read now: services started after the proxy wrote their keys since.
                Security(stack_keys(self._key_dir)[sender]).client(sock, self._security.keys.public)
            sock.connect(f"tcp://127.0.0.1:{self._target_port + rank}")
            self._outbound[(rank, sender)] = sock
        return sock

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._inbound:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            for rank, sender, frames in pending:
                self._out(rank, sender).send_multipart(frames, flags=zmq.NOBLOCK)
            for sock, _ in poller.poll(20):
                rank = self._inbound.index(sock)
                received = sock.recv_multipart(copy=False)
                sender = received[0].get("User-Id") if self._security.keys else ""
                for frames in singles([bytes(f) for f in received]):
                    msg, _ = protocol.decode(frames)
                    if self._hold(msg):
                        with self._lock:
                            self.held.append((rank, sender, frames))
                    else:
                        self.passed.append((rank, msg))
                        self._out(rank, sender).send_multipart(frames, flags=zmq.NOBLOCK)

    def inject(self, frames: Frames, like: Frames | None = None) -> None:
        """Send ``frames`` on as if it came the way the held message ``like`` did
        (default: the held message of the same room)."""
        room = protocol.decode(frames)[0].transfer if like is None else None
        with self._lock:
            rank, sender, _ = next(
                h
                for h in self.held
                if h[2] is like or (like is None and protocol.decode(h[2])[0].transfer == room)
            )
            self._pending.append((rank, sender, frames))

    def release(self, room: int | None = None) -> None:
        """Send on the held messages (only those of ``room`` if given)."""
        with self._lock:
            keep = []
            for held in self.held:
                if room is None or protocol.decode(held[2])[0].transfer == room:
                    self._pending.append(held)
                else:
                    keep.append(held)
            self.held = keep

    def held_for(self, room: int, rank: int | None = None) -> Frames:
        with self._lock:
            return next(
                f for r, _, f in self.held if protocol.decode(f)[0].transfer == room and rank in (None, r)
            )

    def drop(self, room: int) -> None:
        with self._lock:
            self.held = [h for h in self.held if protocol.decode(h[2])[0].transfer != room]

    def held_rooms(self) -> set[int]:
        with self._lock:
            return {protocol.decode(frames)[0].transfer for _, _, frames in self.held}


def in_front_of(service: Service, hold: Hold, ranks: int = 1) -> HoldingProxy:
    """A proxy that ``service`` (not started yet) will advertise as its ZMQ endpoints."""
    proxy = HoldingProxy(service, hold, ranks)
    service.args += ["--advertise-zmq-port", str(proxy.port)]
    return proxy
