"""The bootstrap's REST API in process: credentials, validation and error codes."""

import json

import pytest
from fastapi.testclient import TestClient

from bootstrap.app import create_app
from bootstrap.settings import BootstrapSettings
from launcher.local_stack import free_port
from shared.kv.head_split import kv_heads
from shared.wire.security import CurveKeys

JOIN = "join-secret-for-tests"
KEY = "client-api-key"
AUTH = {"Authorization": f"Bearer {JOIN}"}
CLIENT = {"Authorization": f"Bearer {KEY}"}
JSON = {"content-type": "application/json"}


def model(**changes):
    return {
        "name": "reference",
        "architecture": "kvroom-reference",
        "weights": "seed-1234",
        "tokenizer": "bytes",
        "dtype": "float64",
        "num_layers": 2,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 8,
        "vocab_size": 256,
        "page_size": 16,
        **changes,
    }


def registration(node_id="p0", role="prefill", port=5555, tp=1, key=True, **model_changes):
    ranks = []
    for r in range(tp):
        heads = kv_heads(r, tp, model(**model_changes)["num_kv_heads"])
        ranks.append(
            {
                "rank": r,
                "session_id": f"127.0.0.1:{4000 + r}",
                "zmq_endpoint": f"tcp://127.0.0.1:{port + r}",
                "public_key": CurveKeys.generate().public if key else "",
                "kv_head_start": heads.start,
                "kv_head_count": heads.count,
            }
        )
    return {
        "node_id": node_id,
        "role": role,
        "http_url": "http://127.0.0.1:1",
        "version": "test",
        "ranks": ranks,
        "model": model(**model_changes),
        "num_pages": 64,
    }


def make_client(**overrides):
    settings = BootstrapSettings(
        http_port=free_port(),
        zmq_port=free_port(),
        max_prompt_tokens=100,
        max_new_tokens=50,
        max_body_bytes=64 * 1024,
        join_token=JOIN,
        **overrides,
    )
    return TestClient(create_app(settings))


@pytest.fixture
def client():
    with make_client() as c:
        yield c


def two_nodes(client):
    assert client.post("/nodes", json=registration(), headers=AUTH).status_code == 201
    assert (
        client.post("/nodes", json=registration("d0", "decode", port=5556), headers=AUTH).status_code == 201
    )


def test_health_and_metrics_stay_open(client):
    assert client.get("/health").json()["status"] == "ok"
    text = client.get("/metrics").text
    assert "kvroom_live_prefill_nodes 0.0" in text


def test_nodes_need_the_join_token_and_never_see_it(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": JOIN}):
        resp = client.post("/nodes", json=registration(), headers=headers)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert client.put("/nodes/p0/heartbeat", json={}, headers=headers).status_code == 401
        assert client.get("/params-key", headers=headers).status_code == 401
    assert client.get("/nodes").json() == []
    answers = [client.post("/nodes", json=registration(), headers=AUTH)]
    answers.append(client.put("/nodes/p0/heartbeat", json={}, headers=AUTH))
    answers += [client.get(path) for path in ("/nodes", "/health", "/metrics", "/openapi.json", "/")]
    assert [a.status_code for a in answers[:2]] == [201, 200]
    for answer in answers:
        assert JOIN not in answer.text
    (me,) = answers[0].json()["bootstraps"]
    assert me["public_key"] and me["report_endpoint"].startswith("tcp://")
    # The key for transfer parameters goes to members only, the same in every answer.
    key = client.get("/params-key", headers=AUTH).json()["params_key"]
    assert answers[0].json()["params_key"] == answers[1].json()["params_key"] == key
    for answer in answers[2:]:
        assert key not in answer.text


def test_client_routes_need_the_api_key_when_one_is_set():
    with make_client(api_key=KEY) as client:
        two_nodes(client)
        body = {"prompt": "hi", "max_new_tokens": 2}
        assert client.post("/rooms", json=body).status_code == 401
        assert client.post("/rooms", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.get("/rooms").status_code == 401
        assert client.get("/rooms/5").status_code == 401
        room = client.post("/rooms", json=body, headers=CLIENT)
        assert room.status_code == 201
        assert client.get(f"/rooms/{room.json()['room']}", headers=CLIENT).status_code == 200
        assert client.get("/health").status_code == 200  # still open


def test_no_live_node_is_503(client):
    resp = client.post("/rooms", json={"prompt": "hi", "max_new_tokens": 2})
    assert resp.status_code == 503 and "prefill" in resp.json()["detail"]
    client.post("/nodes", json=registration(), headers=AUTH)
    resp = client.post("/rooms", json={"prompt": "hi", "max_new_tokens": 2})
    assert resp.status_code == 503 and "decode" in resp.json()["detail"]


def test_a_store_that_cannot_be_reached_is_503_with_retry_after(client, monkeypatch):
    from bootstrap.store import StoreUnavailable

    async def gone(*args, **kwargs):
        raise StoreUnavailable("redis at redis://127.0.0.1:1/0: connection refused")

    store = client.app.state.cluster.store
    for name in ("nodes", "room", "recent", "ping"):
        monkeypatch.setattr(store, name, gone)
    for method, path in (("POST", "/rooms"), ("GET", "/rooms/7"), ("GET", "/rooms"), ("GET", "/health")):
        resp = client.request(method, path, json={"prompt": "hi", "max_new_tokens": 2})
        assert resp.status_code == 503, (path, resp.text)
        assert "redis" in resp.text
    assert client.post("/rooms", json={"prompt": "hi", "max_new_tokens": 2}).headers["retry-after"] == "1"
    resp = client.post("/v1/completions", json={"model": "reference", "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 503 and "redis" in resp.json()["error"]["message"]


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
        {"prompt": "a", "max_new_token": 3},  # a typo: named back
    ],
)
def test_bad_room_bodies_are_422(client, body):
    two_nodes(client)
    resp = client.post("/rooms", json=body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"]
    if "max_new_token" in body:
        assert resp.json()["detail"][0]["loc"] == ["body", "max_new_token"]


def test_text_that_is_not_unicode_is_422_not_500(client):
    two_nodes(client)
    raw = b'{"prompt": "\\ud800", "max_new_tokens": 3}'  # a lone surrogate, as JSON allows it
    resp = client.post("/rooms", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 422 and "unicode" in resp.json()["detail"][0]["msg"]
    unknown = b'{"prompt": "a", "\\udcff": 1}'  # even an unknown field named that way
    resp = client.post("/rooms", content=unknown, headers={"content-type": "application/json"})
    assert resp.status_code == 422
    json.loads(resp.text)


def test_unknown_room_is_404(client):
    assert client.get("/rooms/12345").status_code == 404
    assert client.delete("/rooms/12345").status_code == 404
    assert client.get("/rooms/not-a-number").status_code == 422
    assert client.get("/rooms", params={"state": "DONE"}).status_code == 422
    assert client.get("/rooms", params={"limit": 0}).status_code == 422


@pytest.mark.parametrize(
    ("method", "path", "params", "body", "headers", "status", "locs"),
    [
        ("POST", "/rooms", {"wait": "soon"}, b'{"prompt": "a"}', JSON, 422, [["query", "wait"]]),
        (
            "POST",
            "/rooms",
            {"wait": "-1"},
            b'{"prompt": 5}',
            JSON,
            422,
            [["query", "wait"], ["body", "prompt"]],
        ),
        (
            "POST",
            "/rooms",
            {"wait": "-1"},
            b'{"prompt": "a"',
            JSON,
            422,
            [["body", 14]],
        ),  # not JSON: that alone
        ("POST", "/rooms", {}, b'{"prompt": "a"}', {}, 422, [["body"]]),  # not declared JSON
        ("POST", "/rooms", {}, b"", JSON, 422, [["body"]]),
        ("POST", "/rooms", {}, b"[" * 5000 + b"]" * 5000, JSON, 400, None),  # nested too deep to parse
        ("GET", "/rooms/" + "9" * 5000, {}, b"", {}, 422, [["path", "room"]]),
        ("GET", "/rooms/99999999999999999999", {}, b"", {}, 404, None),
        ("GET", "/rooms/7", {"wait": "x"}, b"", {}, 422, [["query", "wait"]]),
    ],
)
def test_the_room_routes_refuse_what_their_schema_refuses(
    client, method, path, params, body, headers, status, locs
):
    two_nodes(client)
    resp = client.request(method, path, params=params, content=body, headers=headers)
    assert resp.status_code == status, resp.text
    if locs is not None:
        assert [error["loc"] for error in resp.json()["detail"]] == locs
    assert client.get("/rooms").json() == []  # nothing was placed


def test_the_room_routes_are_documented(client):
    paths = client.get("/openapi.json").json()["paths"]
    create, read = paths["/rooms"]["post"], paths["/rooms/{room}"]["get"]
    assert [(p["name"], p["in"], p["required"]) for p in create["parameters"]] == [("wait", "query", False)]
    body = create["requestBody"]["content"]["application/json"]["schema"]
    assert set(body["properties"]) == {"prompt", "input_ids", "max_new_tokens"}
    assert body["additionalProperties"] is False
    assert [(p["name"], p["in"], p["required"]) for p in read["parameters"]] == [
        ("room", "path", True),
        ("wait", "query", False),
    ]
    assert read["parameters"][1]["schema"]["minimum"] == 0
    assert {"201", "422"} <= set(create["responses"]) and {"200", "422"} <= set(read["responses"])


def test_body_far_too_large_is_413(client):
    resp = client.post("/rooms", content=b"x" * (65 * 1024), headers={"content-type": "application/json"})
    assert resp.status_code == 413

    def chunks():  # no content-length: counted as it streams in
        for _ in range(100):
            yield b"x" * 4096

    resp = client.post("/rooms", content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["detail"] == "request body too large"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"page_size": 32}, "page_size"),
        ({"weights": "other-seed"}, "weights"),
        ({"num_kv_heads": 8}, "num_kv_heads"),
        ({"dtype": "float32"}, "dtype"),
    ],
)
def test_incompatible_models_refuse_to_pair_naming_the_field(client, changes, field):
    assert client.post("/nodes", json=registration(), headers=AUTH).status_code == 201
    resp = client.post("/nodes", json=registration("d0", "decode", port=5556, **changes), headers=AUTH)
    assert resp.status_code == 409 and f"{field} differs" in resp.json()["detail"]


def test_ranks_whose_heads_cannot_map_are_refused(client):
    reg = registration(tp=2)
    reg["ranks"][1]["kv_head_start"] = 1  # overlaps rank 0, leaves head 3 to nobody
    resp = client.post("/nodes", json=reg, headers=AUTH)
    assert resp.status_code == 409 and "rank 1 holds KV heads [1, 3)" in resp.json()["detail"]
    reg = registration(tp=3)  # 4 KV heads neither split over nor replicate onto 3 ranks
    resp = client.post("/nodes", json=reg, headers=AUTH)
    assert resp.status_code == 409 and "3 ranks" in resp.json()["detail"]
    reg = registration(key=False)
    resp = client.post("/nodes", json=reg, headers=AUTH)
    assert resp.status_code == 409 and "CURVE" in resp.json()["detail"]


def test_registration_validation(client):
    assert client.post("/nodes", json=registration(), headers=AUTH).status_code == 201
    for field, value in [
        ("role", "router"),
        ("node_id", "a b"),
        ("num_pages", 0),
        ("ranks", []),
        ("extra", 1),
    ]:
        assert client.post("/nodes", json=registration() | {field: value}, headers=AUTH).status_code == 422
    assert client.put("/nodes/nobody/heartbeat", json={}, headers=AUTH).status_code == 404
    assert client.put("/nodes/p0/heartbeat", json={"free_pages": -1}, headers=AUTH).status_code == 422
    nodes = client.get("/nodes").json()
    assert [n["node_id"] for n in nodes] == ["p0"]


def test_room_is_placed_and_can_be_aborted(client):
    two_nodes(client)
    body = client.post("/rooms", json={"input_ids": [72, 105], "max_new_tokens": 4}).json()
    assert body["state"] == "BOOTSTRAPPING" and 0 < body["room"] < 2**53
    assert body["prefill"]["session_ids"] == ["127.0.0.1:4000"]
    assert client.get(f"/rooms/{body['room']}", params={"wait": 1000}).status_code == 422
    aborted = client.delete(f"/rooms/{body['room']}").json()
    assert aborted["state"] == "FAILED" and aborted["reason"] == "aborted" and aborted["finished"]
    assert client.get(f"/rooms/{body['room']}", params={"wait": 5}).json()["state"] == "FAILED"


def test_a_draining_or_unhealthy_node_gets_no_rooms(client):
    two_nodes(client)
    client.post("/nodes", json=registration("d1", "decode", port=5557), headers=AUTH)
    assert client.post("/nodes/d0/drain").status_code == 401
    assert client.post("/nodes/d0/drain", headers=AUTH).json()["draining"]
    placed = {client.post("/rooms", json={"prompt": "x", "max_new_tokens": 2}).json()["decode"]["node_id"]}
    placed |= {client.post("/rooms", json={"prompt": "y", "max_new_tokens": 2}).json()["decode"]["node_id"]}
    assert placed == {"d1"}
    room = client.post("/rooms", json={"prompt": "z", "max_new_tokens": 2}).json()["room"]
    beat = {"healthy": False, "problem": "rank 1 exited with code -9"}
    assert client.put("/nodes/d1/heartbeat", json=beat, headers=AUTH).status_code == 200
    failed = client.get(f"/rooms/{room}", params={"wait": 5}).json()  # no other decode to place it on
    assert (failed["state"], failed["reason"]) == ("FAILED", "peer_lost")
    assert [a["state"] for a in failed["attempts"]] == ["FAILED", "FAILED"]
    assert client.post("/rooms", json={"prompt": "w", "max_new_tokens": 2}).status_code == 503
    nodes = {n["node_id"]: n for n in client.get("/nodes").json()}
    assert nodes["d1"]["problem"] == "rank 1 exited with code -9" and not nodes["d1"]["healthy"]
    assert client.delete("/nodes/d0", params={"cause": "lost"}, headers=AUTH).status_code == 422
    assert client.delete("/nodes/d0", params={"cause": "rank_death"}, headers=AUTH).status_code == 200
    assert "d0" not in {n["node_id"] for n in client.get("/nodes").json()}
    assert 'kvroom_nodes_left_total{cause="rank_death"} 1.0' in client.get("/metrics").text


def test_room_history_is_bounded():
    import asyncio

    from bootstrap import rooms
    from bootstrap.store import Attempt, MemoryStore, RoomData
    from bootstrap.waiters import Waiters

    async def run():
        store = MemoryStore(history=3, events=Waiters())
        made = [
            RoomData(
                room=i,
                input_ids=[1],
                max_new_tokens=1,
                stop=[],
                stream=False,
                created=0.0,
                attempts=[Attempt(i, "p", "d")],
            )
            for i in range(1, 7)
        ]

        async def end(room):
            await store.update_room(room.room, lambda r: rooms.end(r, "aborted"))

        for room in made[:4]:
            await store.create_room(room)
        assert len(await store.recent(10)) == 4  # the oldest is still in flight: kept
        await end(made[0])
        assert [r.room for r in await store.recent(10)] == [4, 3, 2]
        for room in made[4:]:
            await store.create_room(room)
            await end(room)
        assert (
            len(await store.recent(10)) == 5
        )  # 2..4 in flight hold the head; nothing finished behind is lost
        for room in made[1:4]:
            await end(room)
        assert [r.room for r in await store.recent(10)] == [6, 5, 4]

    asyncio.run(run())


def test_a_fault_of_the_bootstraps_own_is_a_500_in_the_routes_shape():
    settings = BootstrapSettings(http_port=free_port(), zmq_port=free_port(), join_token=JOIN)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        two_nodes(client)

        def broken(text):
            raise RuntimeError("a bug, on purpose")

        client.app.state.cluster.tokenizer.encode = broken
        body = {"model": "reference", "prompt": "hi"}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 500
        assert answer.json()["error"] == {
            "message": "internal error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
        answer = client.post("/rooms", json={"prompt": "hi"})
        assert (answer.status_code, answer.json()) == (500, {"detail": "internal error"})


@pytest.mark.parametrize(("prompt_tokens", "max_new_tokens"), [(80, 1), (40, 40)])
def test_a_room_larger_than_every_pool_is_refused_at_once_on_both_routes(prompt_tokens, max_new_tokens):
    with make_client(max_wait_s=30) as client:
        for node_id, role, port in (("p0", "prefill", 5555), ("d0", "decode", 5556)):
            reg = registration(node_id, role, port=port)
            reg["num_pages"] = 4  # 64 tokens of 16-token pages
            assert client.post("/nodes", json=reg, headers=AUTH).status_code == 201
        prompt = "x" * prompt_tokens
        room = client.post("/rooms", json={"prompt": prompt, "max_new_tokens": max_new_tokens})
        assert room.status_code == 400, room.text
        assert "largest" in room.json()["detail"] and "pool has 4" in room.json()["detail"]
        assert "retry-after" not in room.headers
        body = {"model": "reference", "prompt": prompt, "max_tokens": max_new_tokens}
        completion = client.post("/v1/completions", json=body)
        assert completion.status_code == 400, completion.text
        assert completion.json()["error"]["type"] == "invalid_request_error"
        fits = client.post("/rooms", json={"prompt": "x" * 20, "max_new_tokens": 10})
        assert fits.status_code == 201, fits.text
