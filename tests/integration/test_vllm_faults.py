"""kvroom's guarantee and faults inside vLLM: real vLLM servers whose prefill ranks can hold back or
change their done+aux (tests/support/vllm_hooks.py), behind a kvroom bootstrap that declares a
silent node dead after 4 s. The tests run in order; the last four kill a decode server, kill a
prefill server, kill a prefill's worker process, and stop the last prefill.
"""

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support import until
from tests.support.vllm_servers import VLLM_PYTHON, VllmCluster, tiny_llama

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="bash setup.sh vllm makes .venv-vllm")

HOOKED = {"kv_connector": "HookedKvroomConnector", "kv_connector_module_path": "tests.support.vllm_hooks"}
NODE_TTL_S = 4.0
FAST = {
    # Long enough for 8 rooms to be held in flight at once on a busy 2-core host, short of the
    # bootstrap's own deadline; a frozen or killed prefill is noticed through the node TTL first.
    "transfer_timeout_s": 10.0,
    "lease_timeout_s": 3.0,
    "aux_timeout_s": 1.0,
    # A node whose beat is 2.5 intervals late gets no new room: on a busy 2-core host a beat can
    # be late by most of a second while the node is well.
    "heartbeat_interval_s": 1.0,
    "register_retry_s": 0.2,
}
PROMPT = [17, 93, 211, 5, 388, 42, 250, 7] * 20  # 160 tokens: two blocks


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    return tmp_path_factory.mktemp("hooks")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hooks):
    model = tiny_llama(tmp_path_factory.mktemp("models"))
    bootstrap = ["--node-ttl-s", str(NODE_TTL_S), "--max-attempts", "2"]
    c = VllmCluster(
        tmp_path_factory.mktemp("vllm-faults"), model, bootstrap, HOOKED, {"KVROOM_TEST_HOOKS": str(hooks)}
    )
    try:
        c.start(**FAST)
        yield c
    finally:
        c.stop()
        for server in c.servers:
            print(f"----- {server.name} -----\n{server.log_tail(30)}")


@pytest.fixture(autouse=True)
def no_hooks_left(hooks):
    """Each test starts with no hook set and no held record counted, whatever the last one left."""
    for path in hooks.iterdir():
        path.unlink()


def body(cluster, **extra) -> dict:
    return {"model": cluster.model.name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}


def blocks_free(*servers) -> bool:
    return all(s.metric("vllm:kv_cache_usage_perc") == 0 for s in servers)


class Stream:
    """A streamed completion read on a thread: its room id at once, then its text."""

    def __init__(self, cluster, leave: threading.Event | None = None):
        """``leave``: the client closes its connection once it is set, after the first event."""
        self.room: str | None = None
        self.text = ""
        self.error: dict | None = None
        self.left = 0.0  # when it closed its connection
        self._leave = leave
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self.done = self._pool.submit(self._read, cluster)

    def _read(self, cluster) -> None:
        with (
            cluster.client() as client,
            client.stream("POST", "/v1/completions", json=body(cluster, stream=True)) as r,
        ):
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                self.room = self.room or event.get("id", "").removeprefix("cmpl-")
                if "error" in event:
                    self.error = event["error"]
                    return
                if self._leave is not None:
                    self._leave.wait(60)
                    self.left = time.monotonic()
                    return  # the connection closes mid-stream
                self.text += event["choices"][0]["text"]


def room(cluster, room_id: str) -> dict:
    with cluster.client() as client:
        return client.get(f"/rooms/{room_id}").json()


def test_vllm_does_not_start_decoding_until_the_aux_record_lands(cluster, hooks):
    decode = cluster.servers[1]
    with cluster.client() as client:
        answer = client.post("/v1/completions", json=body(cluster))
        assert answer.status_code == 200, answer.text
    (hooks / "hold").touch()
    try:
        stream = Stream(cluster)
        until(lambda: list(hooks.glob("held-*")), what="a done+aux held back")
        # The KV is written; its aux record is not in. The room is not SUCCESS, vLLM decodes nothing.
        assert room(cluster, stream.room)["transfer_state"] != "SUCCESS"
        assert decode.metric("vllm:num_requests_running") == 0
        assert stream.text == ""
    finally:
        (hooks / "hold").unlink()
    stream.done.result(timeout=60)
    assert stream.error is None and stream.text == answer.json()["choices"][0]["text"]
    assert room(cluster, stream.room)["state"] == "SUCCESS"


def test_a_record_changed_in_flight_ends_the_request_with_an_error_and_frees_the_blocks(cluster, hooks):
    prefill, decode = cluster.servers
    (hooks / "tamper").touch()
    try:
        with cluster.client() as client:
            answer = client.post("/v1/completions", json=body(cluster))
    finally:
        (hooks / "tamper").unlink()
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "aux_timeout"  # no intact record ever came
    until(lambda: blocks_free(prefill, decode), what="both servers' blocks free")


def test_a_data_path_that_stops_ends_the_request_at_its_timeout_while_its_blocks_stay_fenced(cluster, hooks):
    """Both servers beat, but no done+aux comes and no revoke is heard: the client's error comes
    at the decode's transfer timeout, while the decode still holds the blocks the prefill could
    write into (for the lease); they are vLLM's again after that."""
    prefill, decode = cluster.servers
    (hooks / "hold").touch()
    (hooks / "deaf").touch()
    try:
        with cluster.client() as client:
            answer = client.post("/v1/completions", json=body(cluster))
        still_fenced = not blocks_free(decode)
    finally:
        (hooks / "hold").unlink()
        (hooks / "deaf").unlink()
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"]["code"] == "transfer_timeout"
    assert still_fenced  # the error did not wait for the fence to end
    until(lambda: blocks_free(prefill, decode), what="both servers' blocks free")


def leave_and_see_blocks_back(cluster, decode, streams: list["Stream"], leave: threading.Event) -> None:
    """The clients of ``streams`` leave: the decode's blocks come back well before the lease would
    give them back (held for it, the last room's would be back 3 s after its client left at the
    earliest), and every room ends aborted."""
    leave.set()
    for stream in streams:
        stream.done.result(timeout=60)
    gone = max(stream.left for stream in streams)
    before_lease = gone + 0.8 * FAST["lease_timeout_s"] - time.monotonic()
    until(lambda: blocks_free(decode), before_lease, "the decode's blocks back before the lease")
    print(f"the decode's blocks were back {time.monotonic() - gone:.2f}s after the clients left")
    for stream in streams:
        until(lambda s=stream: room(cluster, s.room)["finished"], what=f"room {stream.room} ended")
        view = room(cluster, stream.room)
        assert (view["state"], view["reason"]) == ("FAILED", "aborted"), view


def test_clients_that_leave_mid_stream_abort_both_requests(cluster, hooks):
    """Clients leave while their rooms' KV is written and their done+aux held: the decode's blocks
    come back because the prefill answers its revokes at once (nothing of them can still be
    written), well before the lease would give them back."""
    prefill, decode = cluster.servers
    (hooks / "hold").touch()
    leave = threading.Event()
    try:
        left = [Stream(cluster, leave) for _ in range(8)]
        until(lambda: len(list(hooks.glob("held-*"))) == len(left), what="every room's done+aux held")
        assert not blocks_free(decode)
        leave_and_see_blocks_back(cluster, decode, left, leave)
    finally:
        (hooks / "hold").unlink()
    until(lambda: blocks_free(prefill, decode), what="both servers' blocks free")


def bootstrap_metric(cluster, sample: str) -> float:
    """One sample of the bootstrap's Prometheus metrics, named with its labels (0 if none yet)."""
    for line in httpx.get(f"{cluster.bootstrap.url}/metrics", timeout=5.0).text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


ABORTED = 'kvroom_room_failures_total{reason="aborted"}'
LEFT = 'kvroom_nodes_left_total{cause="shutdown"}'
# Blocks of failed loads a decode gave back on its writers' certain end (vLLM publishes it a step later).
FREED_ON_WRITERS_END = "vllm:kvroom_failed_load_blocks_writers_gone_total"


def test_a_client_that_leaves_a_whole_completion_aborts_both_requests(cluster, hooks):
    """Not streamed, the client hears nothing before the end; it leaves before that, and the room
    ends on both servers then (as vLLM ends a request whose client left), not when it would have
    finished."""
    prefill, decode = cluster.servers[:2]
    aborted = bootstrap_metric(cluster, ABORTED)
    payload = json.dumps(body(cluster)).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: kvroom\r\nContent-Type: application/json\r\n"
    (hooks / "hold").touch()
    try:
        with socket.create_connection(("127.0.0.1", cluster.bootstrap.http_port)) as client:
            client.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            until(lambda: list(hooks.glob("held-*")), what="its done+aux held")
            assert not blocks_free(decode)
        left = time.monotonic()
        until(lambda: bootstrap_metric(cluster, ABORTED) >= aborted + 1, what="the room aborted")
        before_lease = left + 0.8 * FAST["lease_timeout_s"] - time.monotonic()
        until(lambda: blocks_free(decode), before_lease, "the decode's blocks back before the lease")
    finally:
        (hooks / "hold").unlink()
    until(lambda: blocks_free(prefill, decode), what="both servers' blocks free")


def test_clients_that_leave_before_their_prompts_are_computed_free_the_decodes_blocks_at_once(cluster, hooks):
    """The decode holds blocks for rooms whose prefill has not computed the prompt yet (a live,
    busy prefill) when their clients leave: the prefill answers each revoke with "nothing will be
    written", and the decode's blocks come back well before the lease would give them back."""
    prefill, decode = cluster.servers[:2]
    sent_before = prefill.metric("vllm:kvroom_sends_total")
    (hooks / "stall").touch()
    leave = threading.Event()
    try:
        left = [Stream(cluster, leave) for _ in range(8)]
        until(lambda: len(list(hooks.glob("stalled-*"))) == len(left), what="every prompt waiting")
        until(lambda: not blocks_free(decode), what="the decode's blocks taken")
        leave_and_see_blocks_back(cluster, decode, left, leave)
    finally:
        (hooks / "stall").unlink()
    assert prefill.metric("vllm:num_requests_waiting") == 0  # vLLM aborted them, uncomputed
    assert prefill.metric("vllm:kvroom_sends_total") == sent_before  # and nothing was written


def test_a_frozen_prefill_ends_its_requests_and_the_decode_frees_its_blocks(cluster):
    prefill, decode = cluster.servers
    prefill.signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with cluster.client() as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: client.post("/v1/completions", json=body(cluster)), range(4)))
        assert all(a.status_code in (502, 503) and "error" in a.json() for a in answers), [
            a.text for a in answers
        ]
        assert time.monotonic() - started < FAST["transfer_timeout_s"] + FAST["lease_timeout_s"] + 10
        until(lambda: blocks_free(decode), what="the decode's blocks free")
    finally:
        prefill.signal(signal.SIGCONT)
    until(lambda: blocks_free(prefill), what="the prefill's blocks free")
    cluster.wait_registered(prefill.name)


def held_count(hooks, answers) -> int:
    """Rooms whose done+aux is held; a request that ended, or a room held twice (timed out and
    placed again), fails the test here rather than leaving it to wait."""
    count = len(list(hooks.glob("held-*")))
    ended = [a.result().text for a in answers if a.done()]
    assert count <= 8 and not ended, f"{count} held, ended early: {ended}"
    return count


def kill_with_eight_in_flight(cluster, hooks, victim) -> list[httpx.Response]:
    """8 rooms held in flight (their KV written, their done+aux held), then ``victim`` SIGKILLed;
    every request ends within the node TTL and a few seconds."""
    (hooks / "hold").touch()
    with cluster.client() as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(client.post, "/v1/completions", json=body(cluster)) for _ in range(8)]
        try:
            until(lambda: held_count(hooks, answers) == 8, timeout=90, what="8 rooms held in flight")
            victim.signal(signal.SIGKILL)
            killed = time.monotonic()
        finally:
            (hooks / "hold").unlink()  # what the other prefill holds goes on (all of it, on a failure)
        ended = [a.result(timeout=60) for a in answers]
        assert time.monotonic() - killed < NODE_TTL_S + 15
    return ended


def served_by_other(cluster, other) -> None:
    """Requests two at a time until one room was prefilled by ``other``."""
    with cluster.client() as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
        for _ in range(10):
            answers = list(pool.map(lambda _: client.post("/v1/completions", json=body(cluster)), range(2)))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            rooms = [room(cluster, a.json()["id"].removeprefix("cmpl-")) for a in answers]
            if any(r["prefill"]["node_id"] == other.name for r in rooms):
                return
    raise AssertionError(f"no room was placed on {other.name}")


def live(cluster, role: str):
    """The last server of ``role`` started that still runs (the tests below kill some)."""
    return [s for s in cluster.servers if role in s.name and s.proc is not None and s.proc.poll() is None][-1]


def test_a_decode_killed_with_eight_rooms_in_flight_ends_them_and_the_prefill_frees_its_blocks(
    cluster, hooks
):
    prefill, decode = live(cluster, "prefill"), live(cluster, "decode")
    ended = kill_with_eight_in_flight(cluster, hooks, decode)
    for answer in ended:
        assert answer.status_code in (502, 503), answer.text
        assert answer.json()["error"]["type"] == "server_error"
    until(lambda: blocks_free(prefill), FAST["lease_timeout_s"] + 10, "the prefill's blocks free")
    with httpx.Client(base_url=prefill.url) as client:
        assert client.get("/health").status_code == 200
    # A decode started in its place (as a supervisor would) serves the prefill's rooms.
    again = cluster.server("decode", "vllm-decode-1", 1, **FAST).start()
    again.wait_ready()
    cluster.wait_registered(again.name)
    with cluster.client() as client:
        answer = client.post("/v1/completions", json=body(cluster))
        assert answer.status_code == 200, answer.text


def test_a_prefill_killed_with_eight_rooms_in_flight_moves_them_to_another_prefill(cluster, hooks):
    prefill, decode = live(cluster, "prefill"), live(cluster, "decode")
    with cluster.client() as client:
        want = client.post("/v1/completions", json=body(cluster)).json()["choices"][0]["text"]
    other = cluster.server("prefill", "vllm-prefill-1", 0, **FAST).start()
    other.wait_ready()
    cluster.wait_registered(other.name)
    served_by_other(cluster, other)  # its first requests are slow; not while rooms are held
    ended = kill_with_eight_in_flight(cluster, hooks, prefill)
    assert [a.status_code for a in ended] == [200] * 8, [a.text for a in ended]
    assert all(a.json()["choices"][0]["text"] == want for a in ended)
    until(lambda: blocks_free(decode, other), timeout=FAST["lease_timeout_s"] + 10, what="blocks free")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def read(path: str) -> bytes:
    with contextlib.suppress(OSError):  # the process ended meanwhile
        return Path(path).read_bytes()
    return b""


def worker_process(server) -> int:
    """The pid of the server's vLLM worker: a process of its own under the engine core."""
    (engine,) = [c for c in children(server.proc.pid) if read(f"/proc/{c}/comm").startswith(b"VLLM::Engine")]
    (worker,) = [c for c in children(engine) if b"resource_tracker" not in read(f"/proc/{c}/cmdline")]
    return worker


def test_a_prefill_whose_worker_dies_leaves_at_once_and_the_decode_frees_its_rooms_blocks(cluster, hooks):
    """vLLM ends a server whose worker process died; the connector's part is that the cluster
    hears it at once, well within the node TTL, from the server leaving, and the decode frees the
    blocks of the rooms that failed with it well before their fence would end. A prefill started
    in its place (as a supervisor would) serves."""
    decode, victim = live(cluster, "decode"), live(cluster, "prefill")
    left_before, freed = bootstrap_metric(cluster, LEFT), decode.metric(FREED_ON_WRITERS_END)
    (hooks / "hold").touch()
    with cluster.client() as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(client.post, "/v1/completions", json=body(cluster)) for _ in range(8)]
        try:
            until(lambda: held_count(hooks, answers) == 8, timeout=90, what="8 rooms held in flight")
            os.kill(worker_process(victim), signal.SIGKILL)
            killed = time.monotonic()
            # It left (not taken for dead: that comes at the TTL), and stays gone.
            until(lambda: bootstrap_metric(cluster, LEFT) > left_before, 0.75 * NODE_TTL_S, "the leave")
            left = time.monotonic()
            print(f"the prefill left {left - killed:.2f}s after its worker was killed")
            until(lambda: blocks_free(decode), FAST["lease_timeout_s"], "the decode's blocks back")
            print(f"the decode's blocks were back {time.monotonic() - left:.2f}s after the prefill left")
        finally:
            (hooks / "hold").unlink()
        ended = [a.result(timeout=60) for a in answers]
    for answer in ended:  # no other prefill to move them to
        assert answer.status_code in (502, 503), answer.text
    victim.proc.wait(30)  # vLLM ended the server
    assert all(n["node_id"] != victim.name for n in cluster.nodes())  # not registered again on its way out
    until(lambda: decode.metric(FREED_ON_WRITERS_END) > freed, what="blocks counted as freed on the leave")
    again = cluster.server("prefill", "vllm-prefill-2", 0, **FAST).start()
    again.wait_ready()
    cluster.wait_registered(again.name)
    with cluster.client() as client:
        answer = client.post("/v1/completions", json=body(cluster))
        assert answer.status_code == 200, answer.text


def test_the_last_prefill_stopped_with_eight_rooms_in_flight_leaves_and_the_decode_frees_their_blocks(
    cluster, hooks
):
    """A stopped prefill leaves the cluster once its host's kernel has sent what its sockets held:
    the rooms end with an error, and their decode, told in its next heartbeat's answer that the
    writers are gone, frees their blocks well before the fence (at least the lease after the rooms
    failed) would end."""
    decode, last = live(cluster, "decode"), live(cluster, "prefill")
    freed = decode.metric(FREED_ON_WRITERS_END)
    stopping = threading.Thread(target=last.stop)
    (hooks / "hold").touch()
    try:
        with cluster.client() as client, concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = [pool.submit(client.post, "/v1/completions", json=body(cluster)) for _ in range(8)]
            until(lambda: held_count(hooks, answers) == 8, timeout=90, what="8 rooms held in flight")
            stopping.start()
            until(lambda: all(n["node_id"] != last.name for n in cluster.nodes()), 30, "the prefill left")
            left = time.monotonic()
            until(lambda: blocks_free(decode), FAST["lease_timeout_s"], "the decode's blocks back")
            print(f"the decode's blocks were back {time.monotonic() - left:.2f}s after the prefill left")
            ended = [a.result(timeout=60) for a in answers]
        # Freed on the leave, not at the fence's end:
        until(
            lambda: decode.metric(FREED_ON_WRITERS_END) > freed, what="blocks counted as freed on the leave"
        )
    finally:
        (hooks / "hold").unlink()
        if stopping.ident is not None:
            stopping.join()
    for answer in ended:
        assert answer.status_code in (502, 503), answer.text
        assert answer.json()["error"]["type"] == "server_error"
    with httpx.Client(base_url=decode.url) as client:
        assert client.get("/health").status_code == 200
