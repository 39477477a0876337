"""Rooms on vLLM nodes: the bootstrap sends both requests at once to the nodes' OpenAI servers (a
fake one here, tests/support/fake_vllm.py), takes the transfer's state only from the nodes' own
CURVE reports, and ends, re-places or aborts the attempt by the same rules as on kvroom's nodes.
The proof against real vLLM servers is in tests/vllm/."""

import json
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from bootstrap.store import RoomData, Store
from launcher.local_stack import free_port
from shared.room.states import RoomState
from shared.wire import grants, protocol
from shared.wire.security import CurveKeys, Security
from tests.support import until
from tests.support.fake_vllm import FakeVllm
from tests.unit.bootstrap.silent_node import SilentNode
from tests.unit.bootstrap.test_api import AUTH, make_client, registration

ENGINE = "vllm 0.32.0"
PROMPT = [72, 101, 108, 108]


class VllmNode:
    """A vLLM server with kvroom's connector as the bootstrap sees it: its rank 0's ZMQ socket
    (which must hear nothing from the bootstrap), its OpenAI server, and its scheduler's key, the
    one its reports come from."""

    def __init__(self, context: zmq.Context, node_id: str, role: str, http_url: str, num_pages: int = 64):
        self.id = node_id
        self.leader = SilentNode(context)
        self.reporter_keys = CurveKeys.generate()
        self.reg = self.leader.registration(node_id, role)
        self.reg["model"]["engine"] = ENGINE
        self.reg |= {"http_url": http_url, "report_key": self.reporter_keys.public, "num_pages": num_pages}
        self._sockets: list[zmq.Socket] = []

    def join(self, client) -> None:
        answer = client.post("/nodes", json=self.reg, headers=AUTH)
        assert answer.status_code == 201, answer.text
        self._bootstrap = answer.json()["bootstraps"][0]
        self.params_key = bytes.fromhex(answer.json()["params_key"])

    def report(self, transfer: int, state: RoomState, keys: CurveKeys | None = None) -> None:
        """A RoomReports from the scheduler's key (or ``keys``), as kvroom's connector sends it."""
        sock = self.leader.sock.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        Security(keys or self.reporter_keys).client(sock, self._bootstrap["public_key"])
        sock.connect(self._bootstrap["report_endpoint"])
        self._sockets.append(sock)
        status = protocol.RoomStatus(transfer=protocol.TransferId(transfer), state=int(state))
        sock.send_multipart(protocol.encode(protocol.RoomReports(self.id, [status])))

    def close(self) -> None:
        for sock in [*self._sockets, self.leader.sock]:
            sock.close(0)


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    with FakeVllm() as server:
        yield server


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
def nodes(context, fake) -> Iterator[dict[str, VllmNode]]:
    made = {
        "p0": VllmNode(context, "p0", "prefill", fake.url("p0")),
        "d0": VllmNode(context, "d0", "decode", fake.url("d0")),
    }
    yield made
    for node in made.values():
        node.close()


def room_of(client, room_id: int) -> dict:
    return client.get(f"/rooms/{room_id}").json()


def place(client, max_new_tokens: int = 3) -> int:
    answer = client.post("/rooms", json={"input_ids": PROMPT, "max_new_tokens": max_new_tokens})
    assert answer.status_code == 201, answer.text
    return int(answer.json()["room"])


def held_in_flight(client, fake: FakeVllm, nodes: dict[str, VllmNode]) -> int:
    """A room whose two requests both reached the servers, which hold them."""
    fake.behaviour |= {"p0": "hold", "d0": "hold"}
    nodes["p0"].join(client)
    nodes["d0"].join(client)
    room = place(client)
    until(lambda: len(fake.requests) == 2, 10, "both requests")
    return room


def peers(node: VllmNode) -> list[dict]:
    return [dict(rank) for rank in node.reg["ranks"]]


def test_both_requests_go_at_once_and_the_room_completes_only_on_the_decodes_success_report(fake, nodes):
    p0, d0 = nodes["p0"], nodes["d0"]
    fake.behaviour["p0"] = "hold"
    with make_client(node_ttl_s=60.0) as client:
        p0.join(client)
        d0.join(client)
        room = place(client)
        # The decode's request came while the prefill's was still unanswered: not prefill first.
        until(lambda: fake.got("d0") and fake.got("p0"), 10, "both requests")
        (prefill,) = fake.got("p0")
        assert not prefill.answered
        grant_to_p0 = prefill.body.pop("kv_transfer_params")["kvroom"]
        assert prefill.body == {"model": "reference", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        decode = fake.got("d0")[0].body
        grant_to_d0 = decode.pop("kv_transfer_params")["kvroom"]
        assert decode == {
            "model": "reference",
            "prompt": PROMPT,
            "max_tokens": 3,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        # Each names the transfer, the server's side and its peer's ranks, signed with the cluster's
        # key, which both nodes got at registration.
        assert p0.params_key == d0.params_key
        for grant, role, peer in ((grant_to_p0, "prefill", d0), (grant_to_d0, "decode", p0)):
            checked = msgspec.convert(grant, grants.TransferGrant)
            node = p0.id if role == "prefill" else d0.id
            assert grants.refusal(checked, p0.params_key, role, PROMPT, node) is None
            assert (checked.transfer, checked.peer_node, msgspec.to_builtins(checked.peers)) == (
                room,
                peer.id,
                peers(peer),
            )
            assert grants.refusal(checked, bytes(32), role, PROMPT, node) is not None
            assert grants.refusal(checked, p0.params_key, role, PROMPT, peer.id) is not None
        fake.release("p0")
        until(lambda: prefill.answered and fake.got("d0")[0].answered, 10, "both answers")

        # Both answered; the room waits for the decode node's own report. One from its rank 0's
        # key is not its report: it named its scheduler's key.
        d0.report(room, RoomState.SUCCESS, keys=d0.leader.keys)
        until(
            lambda: 'kvroom_messages_rejected_total{kind="unauthorized"} 1.0' in client.get("/metrics").text,
            10,
            "the report from the wrong key to be refused",
        )
        d0.report(room, RoomState.TRANSFERRING)
        until(lambda: room_of(client, room)["transfer_state"] == "TRANSFERRING", 10, "TRANSFERRING")
        assert not room_of(client, room)["finished"]

        d0.report(room, RoomState.SUCCESS)
        body = client.get(f"/rooms/{room}", params={"wait": 10}).json()
        assert (body["state"], body["outcome"], body["finished"]) == ("SUCCESS", "completed", True)
        assert body["output_ids"] == fake.tokens[:3] and body["finish_reason"] == "length"
        assert "kvroom_rooms_in_flight 0.0" in client.get("/metrics").text


def text_of(lines: list[str]) -> str:
    """The text of an OpenAI completion's server-sent events."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_stop_strings_go_to_the_decode_which_keeps_them_and_the_api_cuts_them(fake, nodes):
    with make_client(node_ttl_s=60.0) as client:
        nodes["p0"].join(client)
        nodes["d0"].join(client)
        request = {"model": "reference", "prompt": PROMPT, "max_tokens": 3, "stream": True, "stop": "i"}
        with client.stream("POST", "/v1/completions", json=request) as response:
            got = until(lambda: fake.got("d0"), 10, "the decode's request")[0]
            nodes["d0"].report(got.body["kv_transfer_params"]["kvroom"]["transfer"], RoomState.SUCCESS)
            lines = list(response.iter_lines())
        assert (got.body["stop"], got.body["include_stop_str_in_output"]) == (["i"], True)
        assert text_of(lines) == "H"  # the decode's "Hi!" up to its stop string


def tokens(client, room: int) -> list[int]:
    store: Store = client.app.state.cluster.store
    return client.portal.call(store.tokens, room)


def test_streamed_tokens_reach_the_store_once_the_room_is_success_and_not_before(fake, nodes):
    fake.behaviour["d0"] = "hold"
    with make_client(node_ttl_s=60.0) as client:
        nodes["p0"].join(client)
        nodes["d0"].join(client)
        request = {"model": "reference", "prompt": PROMPT, "max_tokens": 3, "stream": True}
        with client.stream("POST", "/v1/completions", json=request) as response:
            got = until(lambda: fake.got("d0"), 10, "the decode's request")[0]
            room = got.body["kv_transfer_params"]["kvroom"]["transfer"]
            until(lambda: got.gates == 1, 10, "the decode to hold before its first token")
            fake.release("d0")
            until(lambda: got.gates == 2, 10, "the decode's first token")
            nodes["d0"].report(room, RoomState.TRANSFERRING)
            until(lambda: room_of(client, room)["transfer_state"] == "TRANSFERRING", 10, "TRANSFERRING")
            assert tokens(client, room) == []  # no token goes out before the KV is known to have landed

            nodes["d0"].report(room, RoomState.SUCCESS)
            # The token that came first goes out as SUCCESS lands, not with the decode's next one.
            until(lambda: tokens(client, room) == fake.tokens[:1], 10, "the first token")
            assert got.gates == 2
            fake.release("d0")
            # Streamed while the decode still holds its last token back.
            until(lambda: tokens(client, room) == fake.tokens[:2], 10, "the streamed tokens")
            assert got.gates == 3 and not got.answered
            fake.release("d0")
            lines = list(response.iter_lines())
        assert tokens(client, room) == fake.tokens[:3]
        assert text_of(lines) == "Hi!" and "data: [DONE]" in lines


@pytest.mark.parametrize("fault", ["unreachable", "cut"])
def test_a_decode_that_cannot_be_reached_or_cuts_its_stream_loses_the_attempt_which_is_placed_again(
    context, fake, nodes, fault
):
    url = f"http://127.0.0.1:{free_port()}/d0" if fault == "unreachable" else fake.url("bad")
    fake.behaviour["bad"] = "cut"
    # Most free pages: the first placement goes to the broken decode.
    broken = VllmNode(context, "bad", "decode", url, num_pages=128)
    try:
        with make_client(node_ttl_s=60.0) as client:
            nodes["p0"].join(client)
            nodes["d0"].join(client)
            broken.join(client)
            room = place(client)
            got = until(lambda: fake.got("d0"), 10, "the second attempt's decode request")[0]
            transfer = got.body["kv_transfer_params"]["kvroom"]["transfer"]
            assert transfer != room
            nodes["d0"].report(transfer, RoomState.SUCCESS)
            body = client.get(f"/rooms/{room}", params={"wait": 10}).json()
            assert (body["state"], body["outcome"]) == ("SUCCESS", "completed")
            first, second = body["attempts"]
            assert (first["decode"], first["state"], first["reason"]) == ("bad", "FAILED", "peer_lost")
            assert second["decode"] == "d0"
            assert body["output_ids"] == fake.tokens[:3]
    finally:
        broken.close()


@pytest.mark.parametrize("failing", ["p0", "d0"])
def test_an_http_error_fails_the_room_as_the_nodes_failure_and_ends_the_other_request(fake, nodes, failing):
    other = "d0" if failing == "p0" else "p0"
    fake.behaviour |= {failing: "error", other: "hold"}
    with make_client(node_ttl_s=60.0) as client:
        nodes["p0"].join(client)
        nodes["d0"].join(client)
        room = place(client)
        body = client.get(f"/rooms/{room}", params={"wait": 10}).json()
        role = "prefill" if failing == "p0" else "decode"
        assert (body["state"], body["reason"]) == (
            "FAILED",
            f"{role}_failed",
        )  # the node and status: in the log
        assert len(body["attempts"]) == 1  # the request's own failure: not placed again
        until(lambda: fake.got(other) and fake.got(other)[0].disconnected, 10, "the other request to end")


def test_an_abort_ends_both_requests_and_tells_the_nodes_nothing_over_zmq(fake, nodes):
    with make_client(node_ttl_s=60.0) as client:
        room = held_in_flight(client, fake, nodes)
        aborted = client.delete(f"/rooms/{room}").json()
        assert (aborted["state"], aborted["reason"]) == ("FAILED", "aborted")
        until(lambda: all(r.disconnected for r in fake.requests), 10, "vLLM to see both requests end")
        for node in nodes.values():
            assert node.leader.sock.poll(100) == 0  # no assignment, no AbortRoom


@pytest.mark.parametrize(("how", "writes_ended"), [("left", True), ("unhealthy", False)])
def test_a_vllm_decode_hears_in_its_next_heartbeats_answer_that_its_rooms_writer_left(
    fake, nodes, how, writes_ended
):
    """vLLM serves no AbortRoom: the decode server learns that the prefill process it loads from
    ended (evidence that frees its blocks once what was sent has landed) from the bootstrap's
    answer to its next heartbeat, once; evidence short of that tells it nothing."""
    with make_client(node_ttl_s=60.0, max_attempts=1) as client:
        room = held_in_flight(client, fake, nodes)
        transfer = room_of(client, room)["attempts"][-1]["transfer"]
        if how == "left":
            assert client.delete("/nodes/p0", headers=AUTH).status_code == 200
        else:
            beat = {"healthy": False, "problem": "rank 0 exited with code -9"}
            assert client.put("/nodes/p0/heartbeat", json=beat, headers=AUTH).status_code == 200
        assert room_of(client, room)["reason"] == "peer_lost"
        answers = [client.put("/nodes/d0/heartbeat", json={}, headers=AUTH).json() for _ in range(2)]
        assert [a["writers_gone"] for a in answers] == [[transfer] if writes_ended else [], []]
        assert nodes["d0"].leader.sock.poll(100) == 0  # nothing over ZMQ


def test_closing_the_bootstrap_ends_the_requests_in_flight(fake, nodes):
    with make_client(node_ttl_s=60.0) as client:
        held_in_flight(client, fake, nodes)
    until(lambda: all(r.disconnected for r in fake.requests), 10, "vLLM to see both requests end")


def test_a_vllm_room_no_node_reported_on_is_never_sent_again(fake, nodes):
    with make_client(node_ttl_s=60.0) as client:
        room = held_in_flight(client, fake, nodes)
        cluster = client.app.state.cluster

        def long_ago(r: RoomData) -> bool:
            r.attempt.placed_at = time.time() - 60
            return True

        client.portal.call(cluster.store.update_room, room, long_ago)
        client.portal.call(cluster._lifecycle.sweep)
        body = room_of(client, room)
        assert body["state"] == "BOOTSTRAPPING" and len(body["attempts"]) == 1
        stored = client.portal.call(cluster.store.room, room)
        assert stored.attempt.resent == 0
        assert "kvroom_room_assignments_resent_total 0.0" in client.get("/metrics").text
        assert len(fake.requests) == 2


@pytest.mark.parametrize("vllm_role", ["prefill", "decode"])
def test_kvroom_and_vllm_nodes_never_pair(vllm_role):
    with make_client() as client:
        kvroom_role = "decode" if vllm_role == "prefill" else "prefill"
        assert client.post("/nodes", json=registration("k0", kvroom_role), headers=AUTH).status_code == 201
        reg = registration("v0", vllm_role, port=5560, engine=ENGINE)
        resp = client.post("/nodes", json=reg, headers=AUTH)
        assert resp.status_code == 409
        assert (
            resp.json()["detail"]
            == f"model does not match {kvroom_role} node k0: engine differs: {ENGINE} != kvroom"
        )
