"""Real stacks for the tests that need them: the services as processes on 127.0.0.1, and Redis."""

import contextlib
import socket
import subprocess
import time

import pytest

from launcher.local_stack import LocalStack, free_port
from shared.models.reference import ReferenceModel, configure_determinism

# Short liveness settings so fault tests finish in seconds.
FAST_BOOTSTRAP = ["--node-ttl-s", "1.5"]
FAST_NODE = ["--heartbeat-interval-s", "0.3", "--register-retry-s", "0.2"]
# A prefill that tells the decode of every accept and start at once, for tests that watch the
# states of a room whose done+aux is held (by default only a slow room's decode hears of them).
NOTICES_AT_ONCE = ["--progress-notice-s", "0"]


def _stack(tmp_path, bootstrap_args=None):
    s = LocalStack(tmp_path / "logs", bootstrap_args=bootstrap_args)
    try:
        yield s
    finally:
        s.stop()
        for service in s.services:
            print(f"----- {service.name} -----\n{service.log_tail(40)}")


@pytest.fixture
def stack(tmp_path):
    """A fresh set of real service processes; their log tails are printed for a failing test."""
    yield from _stack(tmp_path)


@pytest.fixture
def fast_stack(tmp_path):
    """Like ``stack``, with a bootstrap that declares a node dead after 1.5 s of silence."""
    yield from _stack(tmp_path, FAST_BOOTSTRAP)


@pytest.fixture(scope="session")
def model():
    configure_determinism()
    return ReferenceModel()


class Redis:
    """A real redis-server on a free port of 127.0.0.1, its data (append-only) in ``directory``."""

    def __init__(self, directory):
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Redis":
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--protected-mode",
            "no",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return self
            if time.monotonic() > deadline:
                raise TimeoutError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@pytest.fixture
def redis(tmp_path):
    server = Redis(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
