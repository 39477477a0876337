"""The API server's check of transfer parameters, around a stand-in for vLLM's app, with the
cluster's key served over real HTTP as the bootstrap serves it (``GET /params-key``)."""

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import msgspec
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvroom_vllm import guard
from kvroom_vllm.guard import TransferParamsGuard
from launcher.local_stack import free_port
from shared.wire import grants, protocol

TOKEN = "join-secret"
PEER = protocol.PeerRank(0, "127.0.0.1:1", "tcp://127.0.0.1:2", "", 0, 2)


class KeyServer:
    """The bootstrap's ``GET /params-key``, behind the join token; ``key`` may change."""

    def __init__(self) -> None:
        self.key = bytes(range(32))
        self.asked = 0

        async def params_key(request: Request) -> JSONResponse:
            if request.headers.get("authorization") != f"Bearer {TOKEN}":
                return JSONResponse({"detail": "join token"}, 401)
            self.asked += 1
            return JSONResponse({"params_key": self.key.hex()})

        self.port = free_port()
        config = uvicorn.Config(
            Starlette(routes=[Route("/params-key", params_key)]), port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "KeyServer":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def key_server() -> Iterator[KeyServer]:
    with KeyServer() as server:
        yield server


def vllm_app(bootstrap_url: str, seen: list[dict]) -> Starlette:
    """What vLLM's OpenAI app is to the guard: routes, and the transfer config in its state."""

    async def completions(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse({"choices": []})

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    extra = {
        "http_url": "http://127.0.0.1:8100",
        "zmq_port": 9100,
        "bootstrap_url": bootstrap_url,
        "join_token": TOKEN,
    }
    transfer_config = SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=extra)
    app.state.vllm_config = SimpleNamespace(kv_transfer_config=transfer_config)
    app.add_middleware(TransferParamsGuard)  # as ``vllm serve --middleware`` adds it
    return app


def body(key: bytes, transfer: int = 9, role: str = "prefill", prompt: int = 5, ttl_s: float = 60.0) -> dict:
    tokens = list(range(prompt))
    grant = grants.TransferGrant(
        transfer,
        role,
        "p0",
        "d0",
        [PEER],
        prompt,
        grants.prompt_digest(tokens),
        time.time() + ttl_s,  # type: ignore[arg-type]
    )
    signed = msgspec.to_builtins(grants.sign(grant, key))
    return {
        "model": "m",
        "prompt": list(range(prompt)),
        "max_tokens": 1,
        "kv_transfer_params": {"kvroom": signed},
    }


def post(app: Starlette, *bodies: dict) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            return [await client.post("/v1/completions", json=b) for b in bodies]

    return asyncio.run(run())


def test_a_grant_the_bootstrap_signed_reaches_vllm_unchanged_and_only_once(key_server):
    seen: list[dict] = []
    good = body(key_server.key)
    first, replay = post(vllm_app(f"http://127.0.0.1:{key_server.port}", seen), good, good)
    assert first.status_code == 200 and seen == [good]
    assert replay.status_code == 403 and "already taken" in replay.json()["error"]["message"]


FORGED = {
    "another key": (body(bytes(32)), 403, "not signed"),
    "for a decode": (body(bytes(range(32)), role="decode"), 403, "for a decode server"),
    "another prompt": ({**body(bytes(range(32))), "prompt": [1, 2]}, 403, "another prompt (5 tokens"),
    "same length, other tokens": ({**body(bytes(range(32))), "prompt": [9] * 5}, 403, "another prompt"),
    "not an object": ({"prompt": [1], "kv_transfer_params": "kvroom"}, 400, "not an object"),
    "in vllm_xargs": ({"prompt": [1], "vllm_xargs": {"kv_transfer_params": "x"}}, 400, "vllm_xargs"),
    "expired": (body(bytes(range(32)), ttl_s=-1.0), 403, "expired"),
    "not a grant": (
        {"prompt": [1], "kv_transfer_params": {"kvroom": {"transfer": 1}}},
        400,
        "not a transfer",
    ),
}


@pytest.mark.parametrize(("request_body", "status", "reason"), FORGED.values(), ids=FORGED.keys())
def test_parameters_the_bootstrap_did_not_issue_are_refused_with_the_reason(
    key_server, request_body, status, reason
):
    seen: list[dict] = []
    (response,) = post(vllm_app(f"http://127.0.0.1:{key_server.port}", seen), request_body)
    assert response.status_code == status and seen == []
    error = response.json()["error"]
    assert reason in error["message"] and error["code"] == status


def test_a_plain_request_goes_through_and_a_new_key_is_asked_for(key_server, monkeypatch):
    monkeypatch.setattr(guard, "KEY_RETRY_S", 0.0)
    seen: list[dict] = []
    app = vllm_app(f"http://127.0.0.1:{key_server.port}", seen)
    plain = {"model": "m", "prompt": "hi", "max_tokens": 4}
    old = body(key_server.key, transfer=1)
    new_key = bytes(range(1, 33))
    new = body(new_key, transfer=2)

    async def run() -> list[int]:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://vllm"
        ) as client:
            answers = [await client.post("/v1/completions", json=plain)]
            answers.append(await client.post("/v1/completions", json=old))
            key_server.key = new_key  # the cluster restarted with a new key
            answers.append(await client.post("/v1/completions", json=new))
            return [a.status_code for a in answers]

    assert asyncio.run(run()) == [200, 200, 200]
    assert seen == [plain, old, new] and key_server.asked == 2  # a plain request asks for nothing


def test_without_the_bootstraps_key_a_grant_is_refused_as_unavailable():
    seen: list[dict] = []
    (response,) = post(vllm_app(f"http://127.0.0.1:{free_port()}", seen), body(bytes(range(32))))
    assert response.status_code == 503 and seen == []
    assert "bootstrap" in json.loads(response.text)["error"]["message"]


def test_parameters_named_with_json_escapes_are_checked_too(key_server):
    seen: list[dict] = []
    app = vllm_app(f"http://127.0.0.1:{key_server.port}", seen)
    forged = json.dumps(body(bytes(32))).replace("kv_transfer_params", "kv_transfer_p\\u0061rams")

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://vllm"
        ) as client:
            return await client.post(
                "/v1/completions", content=forged, headers={"content-type": "application/json"}
            )

    assert asyncio.run(run()).status_code == 403 and seen == []
