"""Start the three services as real processes on 127.0.0.1, for the demo, tests and benchmark.

A stack is secure as in production: one join token for all its services (in
the environment, as ``KVROOM_JOIN_TOKEN``), a CURVE key file per service in
its log directory, and verified KV on the nodes unless told otherwise.
"""

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from shared.wire.security import CurveKeys, write_keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (a node of ``count`` ranks binds them all)."""
    for _ in range(200):
        first = free_port()
        if all(_port_free(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Service:
    def __init__(
        self,
        name: str,
        module: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str],
        keys: Path | None,
        ranks: int = 1,
    ):
        self.name = name
        self.http_port = free_port()
        self.zmq_port = free_ports(ranks)
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_dir / f"{name}.log"
        self.key_file = keys
        self.args = [
            sys.executable,
            "-m",
            module,
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--zmq-port",
            str(self.zmq_port),
            *(["--curve-key-file", str(keys)] if keys else []),
            *args,
        ]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def keys(self) -> CurveKeys:
        assert self.key_file is not None, f"{self.name} runs without CURVE"
        return CurveKeys.load(self.key_file)

    def start(self) -> "Service":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> dict[str, object]:
        """The service's /health body, whether it answers 200 or 503."""
        body: dict[str, object] = httpx.get(f"{self.url}/health", timeout=2.0).json()
        return body

    def wait_healthy(self, timeout: float = 90.0, registered: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = self.health()
                if not registered or (body.get("registered", True) and body.get("status") == "ok"):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s; see {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class LocalStack:
    """A bootstrap plus prefill and decode nodes, stopped on exit from the ``with`` block.

    ``secure`` False runs every service with plain ZMQ and no join token.
    Nodes verify their KV (``--verify-kv``) unless ``verify_kv`` is False.
    """

    def __init__(
        self,
        log_dir: Path,
        env: dict[str, str] | None = None,
        bootstrap_args: list[str] | None = None,
        secure: bool = True,
        verify_kv: bool = True,
    ):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.secure = secure
        self.verify_kv = verify_kv
        self.join_token = secrets.token_urlsafe(24) if secure else None
        base = {k: v for k, v in os.environ.items() if not k.startswith("KVROOM_")}
        self.env = {**base, "PYTHONUNBUFFERED": "1", **(env or {})}
        if self.join_token:
            self.env["KVROOM_JOIN_TOKEN"] = self.join_token
        self.services: list[Service] = []
        self.bootstrap = self._service("bootstrap", "bootstrap", bootstrap_args or [])

    def _service(self, name: str, module: str, args: list[str], ranks: int = 1) -> Service:
        keys = None
        if self.secure:
            _, keys = write_keys(self.log_dir / "keys", name)
        else:
            args = ["--zmq-security", "plain", *args]
        service = Service(name, module, args, self.log_dir, self.env, keys, ranks)
        self.services.append(service)
        return service

    def node(
        self,
        role: str,
        node_id: str,
        args: list[str] | None = None,
        module: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Service:
        """A node of ``role``; ``module`` runs another entry point (a test's), with ``env`` added."""
        module = module or {"prefill": "prefill_node", "decode": "decode_node"}[role]
        args = list(args or [])
        ranks = int(args[args.index("--tp-size") + 1]) if "--tp-size" in args else 1
        verify = ["--verify-kv"] if self.verify_kv else []
        service = self._service(
            node_id,
            module,
            ["--node-id", node_id, "--bootstrap-url", self.bootstrap.url, *verify, *args],
            ranks,
        )
        service.env = {**service.env, **(env or {})}
        return service

    def start(
        self,
        prefill_args: list[str] | None = None,
        decode_args: list[str] | None = None,
    ) -> tuple[Service, Service]:
        """Start the bootstrap, one prefill and one decode node; wait until all are registered."""
        self.bootstrap.start()
        self.bootstrap.wait_healthy(registered=False)
        prefill = self.node("prefill", "prefill-0", prefill_args).start()
        decode = self.node("decode", "decode-0", decode_args).start()
        prefill.wait_healthy()
        decode.wait_healthy()
        return prefill, decode

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.bootstrap.url, timeout=30.0)

    def auth(self) -> dict[str, str]:
        """The header that the node routes of this stack's bootstrap want."""
        return {"Authorization": f"Bearer {self.join_token}"} if self.join_token else {}

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
