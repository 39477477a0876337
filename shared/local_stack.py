"""Start the three services as real processes on 127.0.0.1, for the demo, tests and benchmark."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    def __init__(self, name: str, module: str, args: list[str], log_dir: Path, env: dict[str, str]):
        self.name = name
        self.http_port = free_port()
        self.zmq_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_dir / f"{name}.log"
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
            *args,
        ]
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Service":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def health(self) -> dict[str, object]:
        body: dict[str, object] = httpx.get(f"{self.url}/health", timeout=2.0).json()
        return body

    def wait_healthy(self, timeout: float = 60.0, registered: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"{self.name} exited; see {self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                body = self.health()
                if not registered or body.get("registered", True):
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not healthy after {timeout}s; see {self.log_path}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
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
    """A bootstrap plus prefill and decode nodes, stopped on exit from the ``with`` block."""

    def __init__(
        self, log_dir: Path, env: dict[str, str] | None = None, bootstrap_args: list[str] | None = None
    ):
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.services: list[Service] = []
        self.bootstrap = self._service("bootstrap", "bootstrap", bootstrap_args or [])

    def _service(self, name: str, module: str, args: list[str]) -> Service:
        service = Service(name, module, args, self.log_dir, self.env)
        self.services.append(service)
        return service

    def node(self, role: str, node_id: str, args: list[str] | None = None) -> Service:
        module = {"prefill": "prefill_node", "decode": "decode_node"}[role]
        return self._service(
            node_id,
            module,
            [
                "--node-id",
                node_id,
                "--bootstrap-url",
                self.bootstrap.url,
                *(args or []),
            ],
        )

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

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()

    def __enter__(self) -> "LocalStack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
