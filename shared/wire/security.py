"""Who may talk to whom: CURVE identities for ZMQ, and the secrets that guard HTTP.

Every ZMQ socket between services runs CURVE: each service holds a key pair
(from a file made by ``python -m bootstrap keys``, or made fresh at start-up),
a receiving socket is a CURVE server, and every message that gets through
carries its sender's public key (ZMQ's ``User-Id`` property), which the
receiver checks against the peer the message claims to come from: the
bootstrap for room assignments, the room's own peer ranks for everything
about a room, the registered node for a report.

Plain mode (``zmq_security=plain``) turns all of this off, for tests of the
layers above; it is logged loudly at start and in every health answer.
"""

import hmac
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

from shared.errors import SecretError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


@dataclass(frozen=True)
class CurveKeys:
    public: str  # Z85, 40 characters
    secret: str

    @classmethod
    def generate(cls) -> "CurveKeys":
        public, secret = zmq.curve_keypair()
        return cls(public.decode(), secret.decode())

    @classmethod
    def load(cls, path: Path) -> "CurveKeys":
        """A secret certificate as ``zmq.auth.create_certificates`` writes it (``NAME.key_secret``)."""
        from zmq.auth.certs import load_certificate

        try:
            public, secret = load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise SecretError(f"cannot read CURVE key {path}: {exc}") from exc
        if secret is None:
            raise SecretError(f"{path} holds no secret key (use the .key_secret file)")
        return cls(public.decode(), secret.decode())


def write_keys(directory: Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` into ``directory``."""
    from zmq.auth.certs import create_certificates

    directory.mkdir(parents=True, exist_ok=True)
    public, secret = create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    return Path(public), Path(secret)


def load_public_key(value: str) -> str:
    """A public key given as Z85 text or as the path of a ``.key`` file."""
    if len(value) == 40 and not Path(value).exists():
        try:
            z85.decode(value)
        except (KeyError, ValueError) as exc:
            raise SecretError(f"{value!r} is not a Z85 CURVE public key") from exc
        return value
    from zmq.auth.certs import load_certificate

    try:
        public, _ = load_certificate(value)
    except (OSError, ValueError) as exc:
        raise SecretError(f"cannot read CURVE public key {value}: {exc}") from exc
    return public.decode()


def secrets_match(given: str | None, expected: str) -> bool:
    """Constant-time comparison: how long it takes says nothing about the secret."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


class ZapHandler:
    """Answers ZMQ's authentication requests for one context.

    Every CURVE client is admitted and its messages carry its public key
    (``User-Id``): the CURVE handshake already proves the client holds the
    secret of that key, and whether it is the peer a message claims to come
    from is checked per message, where the room is known. Refusing unknown
    keys here instead would be final: libzmq does not retry a connection
    whose authentication failed, so a node that had not yet heard of a new
    peer would never hear from it. A handshake happens once per connection,
    so the thread is idle almost always.
    """

    def __init__(self, context: zmq.Context):
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            request = self._socket.recv_multipart()
            version, request_id, _domain, _address, _identity, mechanism = request[:6]
            key = request[6] if mechanism == b"CURVE" and len(request) > 6 else b""
            user = z85.encode(key) if len(key) == 32 else b""
            status = b"200" if user else b"400"
            self._socket.send_multipart([version, request_id, status, b"", user, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._socket.close(0)


@dataclass(frozen=True)
class Security:
    """A service's ZMQ identity, or None keys in plain mode."""

    keys: CurveKeys | None

    @property
    def public_key(self) -> str:
        return self.keys.public if self.keys else ""

    def server(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server with this service's keys."""
        if self.keys is None:
            return
        sock.curve_server = True
        sock.curve_publickey = self.keys.public.encode()
        sock.curve_secretkey = self.keys.secret.encode()

    def client(self, sock: zmq.Socket, server_key: str) -> None:
        """Make ``sock`` (not yet connected) a CURVE client of the server holding ``server_key``."""
        if self.keys is None:
            return
        if not server_key:
            raise SecretError("a CURVE peer without a public key")
        sock.curve_serverkey = server_key.encode()
        sock.curve_publickey = self.keys.public.encode()
        sock.curve_secretkey = self.keys.secret.encode()


def security_for(mode: str, key_file: Path | None) -> Security:
    if mode == "plain":
        log.warning(
            "ZMQ security is OFF (zmq_security=plain): any host that reaches these ports can send "
            "messages to this service; use it only for tests on a private machine"
        )
        return Security(None)
    keys = CurveKeys.load(key_file) if key_file is not None else CurveKeys.generate()
    log.info("ZMQ CURVE identity %s%s", keys.public, "" if key_file else " (made at start-up)")
    return Security(keys)
