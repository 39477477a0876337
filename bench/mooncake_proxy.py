"""The proxy in front of a vLLM prefill and decode pair with vLLM's MooncakeConnector, as vLLM's own
example (examples/online_serving/disaggregated_serving/mooncake_connector/mooncake_connector_proxy.py)
does it: each completion goes to the prefill with ``max_tokens: 1`` and
``kv_transfer_params {"do_remote_decode": true, "transfer_id": T}`` and, at the same time, to the
decode with ``{"do_remote_prefill": true, "remote_engine_id": E, "remote_bootstrap_addr": B,
"transfer_id": T}``; the decode looks the prefill's workers up at the Mooncake bootstrap server B,
asks the prefill for the KV of T, and streams its answer back through here. The prefill's own
answer carries no ``kv_transfer_params`` for Mooncake: the transfer id is the proxy's.

    python -m bench.mooncake_proxy --port P --prefill URL --decode URL --bootstrap URL --engine-id E
"""

import argparse
import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("bench.mooncake_proxy")


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    out = {**body, "max_tokens": 1, "stream": False}
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": transfer_id,
    }
    return out


def decode_body(body: dict[str, Any], transfer_id: str, engine_id: str, bootstrap: str) -> dict[str, Any]:
    return {
        **body,
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": engine_id,
            "remote_bootstrap_addr": bootstrap,
            "transfer_id": transfer_id,
        },
    }


def create_app(prefill: str, decode: str, bootstrap: str, engine_id: str) -> Starlette:
    clients: dict[str, httpx.AsyncClient] = {}
    prefills: set[asyncio.Task[None]] = set()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        for name, url in (("prefill", prefill), ("decode", decode)):
            clients[name] = httpx.AsyncClient(base_url=url, timeout=None, limits=limits, trust_env=False)
        yield
        for client in clients.values():
            await client.aclose()

    async def send_prefill(body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            response = await clients["prefill"].post("/v1/completions", json=body, headers=headers)
            if response.is_error:
                log.error("prefill answered %d: %s", response.status_code, response.text[:200])
        except httpx.HTTPError as exc:
            log.error("prefill request failed: %r", exc)

    async def completions(request: Request) -> Response:
        body = await request.json()
        transfer_id = f"xfer-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": transfer_id}
        task = asyncio.create_task(send_prefill(prefill_body(body, transfer_id), headers))
        prefills.add(task)
        task.add_done_callback(prefills.discard)
        upstream = clients["decode"].build_request(
            "POST",
            "/v1/completions",
            json=decode_body(body, transfer_id, engine_id, bootstrap),
            headers=headers,
        )
        response = await clients["decode"].send(upstream, stream=True)
        if not body.get("stream"):
            content = await response.aread()
            await response.aclose()
            return Response(content, response.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return StreamingResponse(relay(), response.status_code, media_type="text/event-stream")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/health", health)]
    return Starlette(routes=routes, lifespan=lifespan)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.mooncake_proxy", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", required=True, help="the prefill vLLM server's URL")
    parser.add_argument("--decode", required=True, help="the decode vLLM server's URL")
    parser.add_argument("--bootstrap", required=True, help="the prefill's Mooncake bootstrap server's URL")
    parser.add_argument("--engine-id", required=True, help="the prefill's kv_transfer_config engine_id")
    args = parser.parse_args()
    app = create_app(args.prefill, args.decode, args.bootstrap, args.engine_id)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
