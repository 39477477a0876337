"""The node's membership against a bootstrap over real HTTP: one that forgot the node gets a new
registration, unless the node is leaving."""

import asyncio
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from launcher.local_stack import free_port
from shared.node.membership import Membership
from shared.node.reports import BootstrapLink
from shared.node.settings import NodeSettings
from shared.wire.registration import Heartbeat
from tests.support import until_async

NODE = "node-under-test"
ANSWER = {
    "node_id": NODE,
    "bootstraps": [{"id": "b0", "report_endpoint": "tcp://127.0.0.1:1", "public_key": ""}],
    "node_ttl_s": 10.0,
    "epoch": "e0",
}


class Bootstrap:
    """Registrations counted; heartbeats answered 404 once it ``forgot`` the node."""

    def __init__(self) -> None:
        self.registrations = 0
        self.beats = 0
        self.forgot = False

        async def register(request: Request) -> JSONResponse:
            self.registrations += 1
            self.forgot = False
            return JSONResponse(ANSWER, 201)

        async def beat(request: Request) -> JSONResponse:
            self.beats += 1
            return JSONResponse({"detail": "unknown node"}, 404) if self.forgot else JSONResponse(ANSWER)

        routes = [
            Route("/nodes", register, methods=["POST"]),
            Route(f"/nodes/{NODE}/heartbeat", beat, methods=["PUT"]),
        ]
        self.port = free_port()
        config = uvicorn.Config(
            Starlette(routes=routes), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture
def bootstrap() -> Iterator[Bootstrap]:
    server = Bootstrap()
    server.thread.start()
    deadline = time.monotonic() + 10
    while not server.server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield server
    server.server.should_exit = True
    server.thread.join(10)


@pytest.mark.parametrize("leaving", [False, True])
def test_a_bootstrap_that_forgot_the_node_registers_it_again_unless_it_is_leaving(bootstrap, leaving):
    async def body() -> None:
        settings = NodeSettings(
            bootstrap_url=f"http://127.0.0.1:{bootstrap.port}",
            heartbeat_interval_s=0.05,
            zmq_security="plain",
            http_port=free_port(),
            zmq_port=free_port(),
        )
        link = BootstrapLink(NODE, lambda *_: None, asyncio.get_running_loop())
        registration = SimpleNamespace(model_dump_json=lambda: "{}", tp_size=1)
        membership = Membership(settings, NODE, link, lambda: registration, Heartbeat, list, lambda _: None)
        run = asyncio.create_task(membership.run())
        try:
            await until_async(lambda: bootstrap.beats > 0, what="a heartbeat")
            if leaving:
                membership.leaving()
            bootstrap.forgot = True  # as after the node's DELETE
            if leaving:
                await asyncio.wait_for(run, 10)  # the beats end
                assert bootstrap.registrations == 1
            else:
                await until_async(lambda: bootstrap.registrations == 2, what="a new registration")
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)

    asyncio.run(body())
