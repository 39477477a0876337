"""The hot room routes answer without FastAPI when the full route would accept the request, and
hand everything else on to it untouched."""

import json

import pytest

from bootstrap.fast_rooms import FastRooms
from tests.unit.bootstrap.test_api import CLIENT, make_client, two_nodes

JSON = {**CLIENT, "Content-Type": "application/json"}


class Downstream:
    """Stands for the FastAPI app: records what reached it."""

    def __init__(self):
        self.seen: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((scope["method"], scope["path"], body))
        await send({"type": "http.response.start", "status": 418, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def stack():
    with make_client(api_key="client-api-key") as client:
        two_nodes(client)
        yield client


def call(client, method, path, query="", body=b"", headers=JSON, chunks=1, gone=False):
    """One request through FastRooms in front of a Downstream; (status, body, downstream)."""
    downstream = Downstream()
    fast = FastRooms(downstream)
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "app": client.app,
    }
    size = max(1, -(-len(body) // chunks))
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    last = len(parts) - 1
    incoming = [{"type": "http.request", "body": p, "more_body": i < last} for i, p in enumerate(parts)]
    if gone:  # the client left (or the body limit refused it) before the body ended
        incoming[-1] = {"type": "http.disconnect"}
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    async def run():
        await fast(scope, receive, send)

    client.portal.call(run)
    if not sent:
        return None, b"", downstream
    status = sent[0]["status"]
    payload = b"".join(m.get("body", b"") for m in sent[1:])
    return status, payload, downstream


def test_a_valid_room_is_placed_and_read_without_fastapi(stack):
    room = json.dumps({"prompt": "hi there", "max_new_tokens": 3}).encode()
    status, body, downstream = call(stack, "POST", "/rooms", body=room, chunks=3)
    assert status == 201 and not downstream.seen
    made = json.loads(body)
    assert made["state"] == "BOOTSTRAPPING" and made["decode"]["node_id"] == "d0"
    status, body, downstream = call(stack, "GET", f"/rooms/{made['room']}", query="wait=0")
    assert status == 200 and not downstream.seen
    assert json.loads(body) == stack.get(f"/rooms/{made['room']}", headers=CLIENT).json()


@pytest.mark.parametrize(
    ("method", "path", "query", "body", "headers"),
    [
        ("POST", "/rooms", "", b'{"prompt": "a", "max_new_token": 3}', JSON),  # a typo
        ("POST", "/rooms", "", b'{"prompt": "a"', JSON),  # not JSON
        ("POST", "/rooms", "", b'{"prompt": "a"}', CLIENT),  # not declared JSON: FastAPI's 422
        ("POST", "/rooms", "", b'{"prompt": "a"}', {**CLIENT, "Content-Type": "text/plain"}),
        ("POST", "/rooms", "", b'{"prompt": "a"}', {"Content-Type": "application/json"}),  # no API key
        ("POST", "/rooms", "", b'{"prompt": "a"}', {**JSON, "Authorization": "Bearer wrong"}),
        ("POST", "/rooms", "wait=1000", b'{"prompt": "a"}', JSON),  # above max_wait_s
        ("POST", "/rooms", "wait=-1", b'{"prompt": "a"}', JSON),
        ("POST", "/rooms", "wait=soon", b'{"prompt": "a"}', JSON),
        ("POST", "/rooms", "wait=%D9%A1", b'{"prompt": "a"}', JSON),  # a digit, but not as FastAPI reads one
        ("POST", "/rooms", "limit=3", b'{"prompt": "a"}', JSON),  # a query the route does not take
        ("GET", "/rooms/12345", "", b"", JSON),  # not known: the route's 404
        ("GET", "/rooms/99999999999999999999", "", b"", JSON),  # not an int64
        ("GET", "/rooms/" + "9" * 5000, "", b"", JSON),  # too long even to read as an int
        ("GET", "/rooms", "", b"", JSON),
        ("DELETE", "/rooms/12345", "", b"", JSON),
    ],
)
def test_anything_else_goes_on_to_fastapi_untouched(stack, method, path, query, body, headers):
    status, _, downstream = call(stack, method, path, query, body, headers, chunks=2)
    assert status == 418
    assert downstream.seen == [(method, path, body)]  # the body read here is handed on whole


def test_errors_after_validation_have_fastapis_shape(stack):
    too_long = json.dumps({"input_ids": [1] * 101, "max_new_tokens": 3}).encode()  # over max_prompt_tokens
    status, body, downstream = call(stack, "POST", "/rooms", body=too_long)
    assert (status, json.loads(body)) == (
        422,
        {"detail": "input_ids: a prompt of 101 tokens exceeds the cap of 100"},
    )
    assert not downstream.seen


def test_a_body_cut_short_places_nothing(stack):
    """The body limit answers 413 and tells the app the client is gone; so does a client leaving."""
    before = len(stack.get("/rooms", headers=CLIENT).json())
    body = json.dumps({"prompt": "hi", "max_new_tokens": 3}).encode()
    status, _, downstream = call(stack, "POST", "/rooms", body=body + b" " * 64, chunks=2, gone=True)
    assert status is None and not downstream.seen
    assert len(stack.get("/rooms", headers=CLIENT).json()) == before
