"""The bootstrap's own blindness is not its nodes' death, and its shutdown does not wait on nodes.

Two real clusters, each shared by its cases: one over a real redis-server, whose Redis is stopped
for two node TTLs while rooms decode; one with its store in the bootstrap's memory, whose bootstrap
is stopped (SIGSTOP) for two TTLs while rooms decode, and which then has a node's rolling restart,
both nodes SIGKILLed and the bootstrap SIGTERMed (the last case, which ends that cluster).
"""

import signal
import subprocess
import time

import httpx
import pytest

from launcher.local_stack import LocalStack, Service
from shared.wire.security import write_keys
from tests.integration.helpers import metric
from tests.support import until
from tests.support.stacks import FAST_BOOTSTRAP, FAST_NODE, Redis

TTL = float(FAST_BOOTSTRAP[FAST_BOOTSTRAP.index("--node-ttl-s") + 1])
# With Redis: nodes beat every second, the bootstrap waits 3 s. A node's next beat after Redis is
# back is up to a second away, a sweep a quarter of one: without the grace it finds the leases
# Redis let run out before the beats renew them.
REDIS_TTL = 3.0
REDIS_NODE = ["--heartbeat-interval-s", "1.0", "--register-retry-s", "0.2"]
# About 1.7 s of decoding each on this host's decode node, one after another: some are still
# decoding when a pause of two TTLs is over.
ROOMS, TOKENS = 8, 1000


class Cluster:
    def __init__(self, stack: LocalStack, prefill: Service, decode: Service, redis: Redis | None = None):
        self.stack, self.prefill, self.decode, self.redis = stack, prefill, decode, redis

    def decoding(self, client: httpx.Client, what: str) -> list[int]:
        """Rooms placed now, once the first of them decodes (its KV arrived, its tokens come)."""
        rooms = [
            client.post("/rooms", json={"prompt": f"{what} {i}", "max_new_tokens": TOKENS}).json()["room"]
            for i in range(ROOMS)
        ]

        def one_decodes() -> bool:
            views = [client.get(f"/rooms/{r}").json() for r in rooms]
            return any(v["state"] == "SUCCESS" and not v["finished"] for v in views)

        until(one_decodes, 30, "a room to decode")
        return rooms

    def all_succeed(self, client: httpx.Client, rooms: list[int]) -> None:
        for room in rooms:
            final = client.get(f"/rooms/{room}", params={"wait": 60}).json()
            assert final["finished"], final
            assert final["state"] == "SUCCESS" and not final["partial"], final
            assert len(final["output_ids"]) == TOKENS, final
            assert len(final["attempts"]) == 1, final  # none failed and was placed again

    def log_size(self) -> int:
        return len(self.stack.bootstrap.log_path.read_text())

    def none_marked_dead(self, since: int) -> None:
        """Both nodes listed alive, and none marked dead since the bootstrap's log was ``since``
        characters long. (A lease that ran out while the store was away is renewed by the node's next
        beat, up to a heartbeat interval after the store is back.)"""

        def alive() -> dict[str, bool]:
            nodes = httpx.get(f"{self.stack.bootstrap.url}/nodes", timeout=5).json()
            return {n["node_id"]: n["alive"] for n in nodes}

        until(lambda: alive() == {"prefill-0": True, "decode-0": True}, 10, "both nodes listed alive")
        assert "marked dead" not in self.stack.bootstrap.log_path.read_text()[since:]
        assert (
            metric(self.stack.bootstrap, "kvroom_nodes_marked_dead_total", 'reason="missed_heartbeats"') == 0
        )


def _cluster(directory, bootstrap_args: list[str], node_args: list[str], redis: Redis | None = None):
    stack = LocalStack(directory / "logs", bootstrap_args=bootstrap_args)
    try:
        prefill, decode = stack.start(node_args, node_args)
        yield Cluster(stack, prefill, decode, redis)
    finally:
        proc = stack.bootstrap.proc
        if proc is not None and proc.poll() is None:  # a failed case may have left it stopped
            proc.send_signal(signal.SIGCONT)
        stack.stop()
        for service in stack.services:
            print(f"----- {service.name} -----\n{service.log_tail(40)}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Its store in the bootstrap's memory, a node TTL of 1.5 s."""
    yield from _cluster(tmp_path_factory.mktemp("observer"), FAST_BOOTSTRAP, FAST_NODE)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    directory = tmp_path_factory.mktemp("observer-redis")
    redis = Redis(directory / "redis").start()
    try:
        yield from _cluster(
            directory, ["--store", redis.url, "--node-ttl-s", str(REDIS_TTL)], REDIS_NODE, redis
        )
    finally:
        redis.stop()


def stopped_for(proc: subprocess.Popen[bytes], seconds: float) -> None:
    """SIGSTOP ``proc`` for ``seconds`` (the length of the fault), then SIGCONT it."""
    start = time.monotonic()
    proc.send_signal(signal.SIGSTOP)
    try:
        until(lambda: time.monotonic() - start > seconds, 30, f"{seconds}s stopped")
    finally:
        proc.send_signal(signal.SIGCONT)


def test_redis_away_for_two_ttls_kills_no_node(redis_cluster):
    cluster, redis = redis_cluster, redis_cluster.redis
    assert redis is not None
    log = cluster.log_size()
    with cluster.stack.client() as client:
        rooms = cluster.decoding(client, "redis away")
        # The nodes beat all along; the bootstrap cannot write it down, and the leases Redis kept
        # (in its append-only file) have run out when it is back.
        gone = time.monotonic()
        redis.stop()
        until(lambda: client.get("/health").status_code == 503, 10, "the bootstrap to lose its store")
        until(lambda: time.monotonic() - gone > 2 * REDIS_TTL, 30, "two TTLs without Redis")
        redis.start()
        until(lambda: client.get("/health").status_code == 200, 20, "the bootstrap to have its store back")
        cluster.all_succeed(client, rooms)
    cluster.none_marked_dead(log)


def test_the_bootstrap_stopped_for_two_ttls_kills_no_node(cluster):
    log = cluster.log_size()
    with cluster.stack.client() as client:
        rooms = cluster.decoding(client, "bootstrap stopped")
        assert cluster.stack.bootstrap.proc is not None
        # Resumed with every lease run out: its first sweep comes before any beat it was sent.
        stopped_for(cluster.stack.bootstrap.proc, 2 * TTL)
        cluster.all_succeed(client, rooms)
    cluster.none_marked_dead(log)


def test_the_bootstrap_exits_on_sigterm_once_its_nodes_are_gone(cluster):
    stack, decode = cluster.stack, cluster.decode
    # A rolling restart: the decode leaves, and comes back at its address with a new key.
    decode.stop()
    write_keys(stack.log_dir / "keys", decode.name)
    decode.start().wait_healthy()
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "after the restart", "max_new_tokens": 4}).json()
        assert client.get(f"/rooms/{room['room']}", params={"wait": 30}).json()["state"] == "SUCCESS"
    cluster.prefill.kill()
    decode.kill()
    bootstrap = stack.bootstrap.proc
    assert bootstrap is not None
    start = time.monotonic()
    bootstrap.send_signal(signal.SIGTERM)
    try:
        bootstrap.wait(2.0)
    except subprocess.TimeoutExpired:
        pytest.fail("the bootstrap did not exit within 2 s of SIGTERM")
    print(f"the bootstrap exited {time.monotonic() - start:.2f}s after SIGTERM")
