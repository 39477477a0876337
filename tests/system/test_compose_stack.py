"""The CPU stack as a user runs it: `docker compose build` and `up` from a clean checkout, the three
services healthy, rooms through `/rooms` and the OpenAI route, metrics, and `down` leaving nothing.

One stack serves every check (the build is minutes); it is torn down by the fixture that made it.
Where no Docker engine can run images, the module is skipped with the reason.
"""

import contextlib
import json
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launcher.local_stack import free_port
from tests.support.docker_host import NoDocker, checkout_copy, cpu_build_inputs, docker, engine, wait_healthy
from tests.support.waiting import until

SERVICES = ("bootstrap", "prefill", "decode")
# The first test waits for the fixture: a fresh host builds the base image and the CPU image.
pytestmark = pytest.mark.timeout(1800)


@dataclass
class Stack:
    compose: list[str]
    env: dict[str, str]
    urls: dict[str, str]

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*self.compose, *args], capture_output=True, text=True, env=self.env, timeout=timeout
        )

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.urls["bootstrap"], timeout=60)


def stack_env(project: str, build_env: dict[str, str]) -> dict[str, str]:
    """Compose's variables: this host's build inputs, free ports on 127.0.0.1, a fresh join token."""
    ports = {
        f"KVROOM_{s.upper()}_{kind}_PORT": str(free_port()) for s in SERVICES for kind in ("HTTP", "ZMQ")
    }
    return {
        **os.environ,
        **build_env,
        **ports,
        "KVROOM_JOIN_TOKEN": uuid.uuid4().hex,
        "KVROOM_IMAGE": f"{project}:cpu",
        "KVROOM_BIND_HOST": "127.0.0.1",
        "KVROOM_DECODE_TP_SIZE": "2",  # a rank process to kill, in the last test
        "KVROOM_BOOTSTRAP_URL": f"http://127.0.0.1:{ports['KVROOM_BOOTSTRAP_HTTP_PORT']}",
        "DOCKER_BUILDKIT": "0",  # the classic builder: BuildKit's frontend may need a registry
    }


@contextlib.contextmanager
def compose_stack(work: Path) -> Iterator[Stack]:
    with engine(work), cpu_build_inputs() as inputs:
        checkout = checkout_copy(work / "checkout", inputs.ca_bundle)
        project = f"kvroom-test-{uuid.uuid4().hex[:8]}"
        env = stack_env(project, inputs.env)
        compose = [
            "docker", "compose", "-p", project,
            "-f", str(checkout / "docker/compose.yaml"), "-f", str(checkout / "docker/compose.cpu.yaml"),
        ]  # fmt: skip
        urls = {s: f"http://127.0.0.1:{env[f'KVROOM_{s.upper()}_HTTP_PORT']}" for s in SERVICES}
        stack = Stack(compose, env, urls)
        try:
            built = stack.run("build", timeout=1500)
            assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
            up = stack.run("up", "-d", timeout=300)
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            try:
                wait_healthy(compose, set(SERVICES), timeout=240, env=env)
            except AssertionError:
                print(stack.run("logs", "--no-color", "--tail", "60").stdout)
                raise
            yield stack
        finally:
            down = stack.run("down", "-v", "--rmi", "local", "--timeout", "20", timeout=300)
            docker("rmi", "-f", env["KVROOM_IMAGE"], check=False)
            assert down.returncode == 0, down.stderr[-2000:]
            left = docker("ps", "-a", "--filter", f"label=com.docker.compose.project={project}", "-q")
            assert left.stdout.strip() == "", f"containers left after down: {left.stdout}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    try:
        with compose_stack(tmp_path_factory.mktemp("compose")) as stack:
            yield stack
    except NoDocker as why:
        pytest.skip(str(why))


def test_every_service_is_healthy_and_serves_metrics(stack):
    for service, url in stack.urls.items():
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200, service
        metrics = httpx.get(f"{url}/metrics", timeout=10)
        assert metrics.status_code == 200, service
        assert "kvroom_" in metrics.text, service


def test_both_nodes_joined_and_a_node_without_the_token_cannot(stack):
    with stack.client() as client:
        nodes = client.get("/nodes")
        assert nodes.status_code == 200, nodes.text
        assert sorted(n["role"] for n in nodes.json()) == ["decode", "prefill"]
        assert client.post("/nodes", json={}).status_code == 401


def test_rooms_succeed_through_rooms(stack):
    with stack.client() as client:
        requests = [{"prompt": f"hello {i}", "max_new_tokens": 4} for i in range(4)]
        created = [client.post("/rooms", json=r) for r in requests]
        for resp in created:
            assert resp.status_code in (200, 201), resp.text
        for resp in created:
            room = resp.json()["room"]
            body = client.get(f"/rooms/{room}", params={"wait": 60}).json()
            assert body["state"] == "SUCCESS", json.dumps(body)


def test_the_openai_route_completes(stack):
    with stack.client() as client:
        resp = client.post("/v1/completions", json={"model": "reference", "prompt": "hello", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")


def rank_processes(stack: Stack, service: str) -> list[int]:
    """Host pids of the service's rank processes past rank 0 (multiprocessing's spawned children)."""
    container = stack.run("ps", "-q", service).stdout.strip()
    top = docker("top", container, "-eo", "pid,args").stdout.splitlines()[1:]
    return [int(line.split(None, 1)[0]) for line in top if "spawn_main" in line]


def test_a_decode_that_loses_a_rank_is_restarted_by_its_restart_policy(stack):
    """Last: it restarts a container. The node exits 1 on its rank's death; Docker starts it again."""
    container = stack.run("ps", "-q", "decode").stdout.strip()
    restarts = int(docker("inspect", "-f", "{{.RestartCount}}", container).stdout)
    (rank1,) = rank_processes(stack, "decode")
    os.kill(rank1, signal.SIGKILL)
    until(
        lambda: int(docker("inspect", "-f", "{{.RestartCount}}", container).stdout) > restarts,
        60,
        "the decode container restarted",
    )
    wait_healthy(stack.compose, {"decode"}, timeout=240, env=stack.env)
    with stack.client() as client:
        until(lambda: any(n["role"] == "decode" for n in client.get("/nodes").json()), 60, "it joined again")
        room = client.post("/rooms", json={"prompt": "back", "max_new_tokens": 4}, params={"wait": 60}).json()
        assert room["state"] == "SUCCESS", json.dumps(room)
