"""The room routes answered by ``HotRoutes`` answer as the app's own routing answers them."""

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from bootstrap.hot_routes import HotRoutes
from bootstrap.store import StoreUnavailable
from tests.unit.bootstrap.test_api import CLIENT, JSON, KEY, make_client, two_nodes

HEADERS = ("content-type", "www-authenticate", "retry-after", "allow")
NESTED = b"[" * 5000 + b"]" * 5000
# method, path, body, headers
REQUESTS = [
    ("POST", "/rooms", b'{"prompt": "hi"}', JSON),  # no key
    ("POST", "/rooms", b'{"prompt": "hi"}', {**JSON, "authorization": "Bearer nope"}),
    ("GET", "/rooms/5", b"", {}),
    ("GET", "/rooms/5?wait=1", b"", {"authorization": KEY}),  # not as a bearer
    ("POST", "/rooms?wait=soon", b'{"prompt": 5}', {**CLIENT, **JSON}),
    ("POST", "/rooms?wait=-1&wait=2", b'{"prompt": "a", "extra": 1}', {**CLIENT, **JSON}),
    ("POST", "/rooms?wait=%2D1", b'{"prompt": "a"', {**CLIENT, **JSON}),
    ("POST", "/rooms", b'{"prompt": "a"}', CLIENT),  # not declared JSON
    ("POST", "/rooms", b"", {**CLIENT, **JSON}),
    ("POST", "/rooms", NESTED, {**CLIENT, **JSON}),
    ("POST", "/rooms", b'{"prompt": "\\ud800"}', {**CLIENT, **JSON}),
    ("POST", "/rooms", b'{"prompt": "a" , "max_new_tokens": 51}', {**CLIENT, **JSON}),
    ("POST", "/rooms", b'{"input_ids": [300]}', {**CLIENT, "content-type": "application/x+json"}),
    ("POST", "/rooms", b"x" * (65 * 1024), {**CLIENT, **JSON}),
    ("POST", "/rooms?wait=1000", b'{"prompt": "a"}', {**CLIENT, **JSON}),
    ("GET", "/rooms/12345", b"", CLIENT),
    ("GET", "/rooms/not-a-number?wait=x", b"", CLIENT),
    ("GET", "/rooms/" + "9" * 30, b"", CLIENT),
    ("GET", "/rooms/7?wait=1000", b"", CLIENT),
    ("PUT", "/rooms/7", b"", CLIENT),
    ("DELETE", "/rooms/7", b"", CLIENT),
    ("GET", "/rooms/7/", b"", CLIENT),
]


def answer(client: TestClient, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple:
    resp = client.request(method, path, content=body, headers=headers, follow_redirects=False)
    return resp.status_code, {h: resp.headers.get(h) for h in HEADERS}, resp.content


@pytest.fixture
def clients() -> Iterator[tuple[TestClient, TestClient]]:
    """The app as it is, and the app with every request routed by FastAPI."""
    # A fault is answered, not raised here: its answers are compared too.
    hot, plain = (TestClient(make_client(api_key=KEY).app, raise_server_exceptions=False) for _ in "ab")
    assert any(m.cls is HotRoutes for m in hot.app.user_middleware)
    plain.app.user_middleware = [m for m in plain.app.user_middleware if m.cls is not HotRoutes]
    for client in (hot, plain):
        client.__enter__()
        two_nodes(client)
    yield hot, plain
    for client in (hot, plain):
        client.__exit__(None, None, None)


@pytest.mark.parametrize(("method", "path", "body", "headers"), REQUESTS)
def test_refusals_are_the_apps_own(clients, method, path, body, headers):
    hot, plain = clients
    assert answer(hot, method, path, body, headers) == answer(plain, method, path, body, headers)


def test_a_room_reads_the_same(clients):
    views = []
    for client in clients:
        body = {"input_ids": [1, 2], "max_new_tokens": 2}
        created = client.post("/rooms?wait=0", json=body, headers=CLIENT)
        read = client.get(f"/rooms/{created.json()['room']}", params={"wait": "0"}, headers=CLIENT)
        assert (created.status_code, read.status_code) == (201, 200)
        assert created.headers["content-type"] == read.headers["content-type"] == "application/json"
        view = read.json()
        views.append((sorted(view), view["state"], view["prefill"]["node_id"], view["decode"]["node_id"]))
    assert views[0] == views[1]


def test_store_outage_and_faults_are_the_apps_own(clients, monkeypatch):
    async def gone(*args, **kwargs):
        raise StoreUnavailable("redis at redis://127.0.0.1:1/0: connection refused")

    def broken(text):
        raise RuntimeError("a bug, on purpose")

    for client in clients:
        for name in ("nodes", "room"):
            monkeypatch.setattr(client.app.state.cluster.store, name, gone)
    post = ("POST", "/rooms", b'{"input_ids": [1]}', {**CLIENT, **JSON})
    for request in (post, ("GET", "/rooms/7", b"", CLIENT)):
        got = [answer(client, *request) for client in clients]
        assert got[0] == got[1] and got[0][0] == 503 and got[0][1]["retry-after"] == "1"
    for client in clients:
        monkeypatch.undo()
        client.app.state.cluster.tokenizer.encode = broken
    got = [answer(client, "POST", "/rooms", b'{"prompt": "hi"}', {**CLIENT, **JSON}) for client in clients]
    assert got[0] == got[1] and got[0][0] == 500
