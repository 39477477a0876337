"""The bootstrap's REST API in process: validation and error codes."""

import pytest
from fastapi.testclient import TestClient

from bootstrap.app import create_app
from bootstrap.settings import BootstrapSettings
from launcher.local_stack import free_port


def registration(node_id="p0", role="prefill", page_size=16, port=5555):
    return {
        "node_id": node_id,
        "role": role,
        "http_url": "http://127.0.0.1:1",
        "ranks": [{"rank": 0, "session_id": "127.0.0.1:4000", "zmq_endpoint": f"tcp://127.0.0.1:{port}"}],
        "kv_layout": {
            "num_layers": 2,
            "num_kv_heads": 4,
            "head_dim": 16,
            "page_size": page_size,
            "dtype": "float32",
        },
        "num_pages": 64,
    }


@pytest.fixture
def client():
    settings = BootstrapSettings(
        http_port=free_port(),
        zmq_port=free_port(),
        max_prompt_tokens=100,
        max_new_tokens=50,
        max_body_bytes=64 * 1024,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def test_health_and_metrics(client):
    assert client.get("/health").json()["status"] == "ok"
    text = client.get("/metrics").text
    assert "kvroom_live_prefill_nodes 0.0" in text


def test_no_live_node_is_503(client):
    resp = client.post("/rooms", json={"prompt": "hi", "max_new_tokens": 2})
    assert resp.status_code == 503 and "prefill" in resp.json()["detail"]
    client.post("/nodes", json=registration())
    resp = client.post("/rooms", json={"prompt": "hi", "max_new_tokens": 2})
    assert resp.status_code == 503 and "decode" in resp.json()["detail"]


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"max_new_tokens": 3},
        {"prompt": "a", "input_ids": [1], "max_new_tokens": 3},
        {"prompt": "", "max_new_tokens": 3},
        {"input_ids": [], "max_new_tokens": 3},
        {"input_ids": [256], "max_new_tokens": 3},
        {"input_ids": [-1], "max_new_tokens": 3},
        {"input_ids": ["a"], "max_new_tokens": 3},
        {"prompt": "a", "max_new_tokens": 0},
        {"prompt": "a", "max_new_tokens": "many"},
        {"prompt": 5, "max_new_tokens": 3},
        {"prompt": "a", "max_new_tokens": 51},
        {"prompt": "a" * 101, "max_new_tokens": 3},
        {"input_ids": [1] * 101, "max_new_tokens": 3},
    ],
)
def test_bad_room_bodies_are_422(client, body):
    client.post("/nodes", json=registration())
    client.post("/nodes", json=registration("d0", "decode", port=5556))
    resp = client.post("/rooms", json=body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"]


def test_unknown_room_is_404(client):
    assert client.get("/rooms/12345").status_code == 404
    assert client.delete("/rooms/12345").status_code == 404
    assert client.get("/rooms/not-a-number").status_code == 422
    assert client.get("/rooms", params={"state": "DONE"}).status_code == 422
    assert client.get("/rooms", params={"limit": 0}).status_code == 422


def test_body_far_too_large_is_413(client):
    resp = client.post("/rooms", content=b"x" * (65 * 1024), headers={"content-type": "application/json"})
    assert resp.status_code == 413

    def chunks():  # no content-length: counted as it streams in
        for _ in range(100):
            yield b"x" * 4096

    resp = client.post("/rooms", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["detail"] == "request body too large"


def test_registration_validation_and_layout_check(client):
    assert client.post("/nodes", json=registration()).status_code == 201
    bad = registration("d0", "decode", page_size=32, port=5556)
    resp = client.post("/nodes", json=bad)
    assert resp.status_code == 409 and "page_size" in resp.json()["detail"]
    for field, value in [("role", "router"), ("node_id", "a b"), ("num_pages", 0), ("ranks", [])]:
        assert client.post("/nodes", json=registration() | {field: value}).status_code == 422
    assert client.put("/nodes/nobody/heartbeat", json={}).status_code == 404
    assert client.put("/nodes/p0/heartbeat", json={"free_pages": -1}).status_code == 422
    nodes = client.get("/nodes").json()
    assert [n["node_id"] for n in nodes] == ["p0"]


def test_room_is_placed_and_can_be_aborted(client):
    client.post("/nodes", json=registration())
    client.post("/nodes", json=registration("d0", "decode", port=5556))
    body = client.post("/rooms", json={"input_ids": [72, 105], "max_new_tokens": 4}).json()
    assert body["state"] == "BOOTSTRAPPING" and 0 < body["room"] < 2**63
    assert body["prefill"]["session_ids"] == ["127.0.0.1:4000"]
    assert client.get(f"/rooms/{body['room']}", params={"wait": 1000}).status_code == 422
    aborted = client.delete(f"/rooms/{body['room']}").json()
    assert aborted["state"] == "FAILED" and aborted["reason"] == "aborted" and aborted["finished"]
    assert client.get(f"/rooms/{body['room']}", params={"wait": 5}).json()["state"] == "FAILED"


def test_room_history_is_bounded():
    from bootstrap.registry import Node, NodeRegistration
    from bootstrap.rooms import RoomBook, RoomRecord

    book = RoomBook(history=3)
    prefill, decode = (
        Node(NodeRegistration(**registration(n, r))) for n, r in (("p", "prefill"), ("d", "decode"))
    )
    records = [RoomRecord(book.new_id(), [1], 1, prefill, decode) for _ in range(6)]
    for record in records[:4]:
        book.add(record)
    assert len(book.rooms) == 4  # the oldest is still in flight: kept
    book.fail(records[0], "aborted")
    assert list(book.rooms) == [r.id for r in records[1:4]]
    for record in records[4:]:
        book.add(record)
        book.fail(record, "aborted")
    assert len(book.rooms) == 5  # records 1..3 in flight hold the head; nothing finished behind them is lost
    for record in records[1:4]:
        book.fail(record, "aborted")
    assert len(book.rooms) == 3 and list(book.rooms) == [r.id for r in records[3:]]
