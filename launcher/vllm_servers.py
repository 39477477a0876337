"""vLLM CPU servers as processes, for the tests and the benchmark: plain, with a KV connector, or
with kvroom's connector behind a kvroom bootstrap.

Each server is a process group of .venv-vllm's Python (the API server, its engine core and its
worker), pinned to one core, bound to 127.0.0.1 on free ports, and stopped by whoever started it.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from launcher.local_stack import LocalStack, Service, free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CONNECTOR = {"kv_connector": "KvroomConnector", "kv_connector_module_path": "kvroom_vllm.connector"}
# The API server's check of transfer parameters, for a server with kvroom's connector.
GUARD = "kvroom_vllm.guard.TransferParamsGuard"


def _until(predicate: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def tiny_llama(directory: Path, *extra: str) -> Path:
    """A tiny random Llama that vLLM's CPU attention serves (head size 64); ``extra`` are more
    arguments of ``launcher.tiny_model`` (``--layers``, ``--heads``), each shape its own folder."""
    out = directory / "-".join(["tiny-llama", *(a.lstrip("-") for a in extra)])
    if not (out / "config.json").exists():
        args = ["-m", "launcher.tiny_model", "--arch", "llama", "--out", str(out), "--head-dim", "64", *extra]
        subprocess.run([sys.executable, *args], check=True, cwd=ROOT, capture_output=True)
    return out


class VllmServer:
    def __init__(
        self, name: str, model: Path, log_dir: Path, core: int, env: dict[str, str] | None = None, tp: int = 1
    ):
        """``core``: the core its worker binds to; with ``tp`` workers, ``core`` to ``core + tp - 1``."""
        self.name = name
        self.tp = tp
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("KVROOM_", "VLLM_"))},
            "PYTHONPATH": str(ROOT),  # a test's own connector (tests.support) loads too
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(core + r) for r in range(tp)),
            **(env or {}),
        }
        self.transfer_config: dict[str, object] | None = None
        self.guard = False
        self.proc: subprocess.Popen[bytes] | None = None

    def with_connector(
        self,
        kv_role: str,
        extra: dict[str, object],
        connector: dict[str, str] = CONNECTOR,
        guard: bool = True,
    ) -> "VllmServer":
        """``guard``: the API server checks transfer parameters (kvroom's connector only)."""
        self.guard = guard and connector["kv_connector"] == CONNECTOR["kv_connector"]
        self.transfer_config = {
            **connector,
            "kv_role": kv_role,
            "kv_load_failure_policy": "fail",  # the policy kvroom recommends (docs/vllm.md)
            "kv_connector_extra_config": {"http_url": self.url, "zmq_port": free_port(), **extra},
        }
        return self

    def start(self) -> "VllmServer":
        args = [
            str(VLLM_PYTHON),
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model)),
            *("--served-model-name", self.model.name, "--dtype", "float32", "--enforce-eager"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "1024"),
            # A stopping server finishes its requests, then shuts its engine down (the connector
            # leaves the cluster then); vLLM's default, 0, kills the engine at once.
            *("--shutdown-timeout", "10"),
            *("--tensor-parallel-size", str(self.tp)),
        ]
        if self.transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.transfer_config)]
        if self.guard:
            args += ["--middleware", GUARD]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT, start_new_session=True
            )
        return self

    def ready(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited:\n{self.errors()}\n...\n{self.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        return False

    def wait_ready(self, timeout: float = 180.0) -> None:
        _until(self.ready, timeout, f"{self.name} to serve")

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the server's Prometheus metrics (0 if it has none yet)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM to the API server alone, which shuts its engine down in order (a signal to the
        whole group would kill the engine at once); what is left of the group after, SIGKILL."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        self.signal(signal.SIGKILL)

    def errors(self, lines: int = 20) -> str:
        """The log's error lines (an engine process's root cause is far above the log's tail)."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").splitlines()
            return "\n".join([line for line in text if "Error" in line or " ERROR " in line][-lines:])
        return ""

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class VllmCluster:
    """A kvroom bootstrap (CURVE, join token) and vLLM servers with kvroom's connector."""

    def __init__(
        self,
        log_dir: Path,
        model: Path,
        bootstrap_args: list[str] | None = None,
        connector: dict[str, str] = CONNECTOR,
        env: dict[str, str] | None = None,
        code_env: dict[str, str] | None = None,
        guard: bool = True,
    ):
        """``code_env``: the environment under which the bootstrap and the connectors import another
        checkout's kvroom (the benchmark's side by side with an older commit, which may have no
        ``guard``)."""
        self.log_dir = log_dir
        self.model = model
        self.connector = connector
        self.env = {**(env or {}), **(code_env or {})}
        self.guard = guard
        self.stack = LocalStack(
            log_dir, bootstrap_args=["--model", str(model), *(bootstrap_args or [])], env=code_env
        )
        self.bootstrap: Service = self.stack.bootstrap
        self.servers: list[VllmServer] = []

    def server(self, role: str, node_id: str, core: int, tp: int = 1, **extra: object) -> VllmServer:
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        env = {"KVROOM_JOIN_TOKEN": self.stack.join_token or "", **self.env}
        settings = {"bootstrap_url": self.bootstrap.url, "node_id": node_id, **extra}
        server = VllmServer(node_id, self.model, self.log_dir, core, env, tp)
        self.servers.append(server.with_connector(kv_role, settings, self.connector, self.guard))
        return server

    def start(self, **extra: object) -> tuple[VllmServer, VllmServer]:
        """The bootstrap, then a prefill and a decode server at once; both registered."""
        self.bootstrap.start()
        self.bootstrap.wait_healthy(registered=False)
        prefill = self.server("prefill", "vllm-prefill-0", 0, 1, **extra).start()
        decode = self.server("decode", "vllm-decode-0", 1, 1, **extra).start()
        for server in (prefill, decode):
            server.wait_ready()
            self.wait_registered(server.name)
        return prefill, decode

    def nodes(self) -> list[dict[str, object]]:
        nodes: list[dict[str, object]] = httpx.get(
            f"{self.bootstrap.url}/nodes", headers=self.stack.auth(), timeout=5.0
        ).json()
        return nodes

    def wait_registered(self, node_id: str, timeout: float = 60.0) -> None:
        _until(lambda: any(n["node_id"] == node_id and n["alive"] for n in self.nodes()), timeout, node_id)

    def client(self, timeout: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.bootstrap.url, timeout=timeout)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.stack.stop()
