"""Nobody forges a SUCCESS: real processes, the real engine, CURVE on every ZMQ socket."""

import asyncio
import signal
import time

import httpx
import pytest
import zmq

from launcher.local_stack import Service
from shared.models.reference import encode_text, generate
from shared.wire import protocol
from shared.wire.security import CurveKeys, Security
from tests.integration.helpers import HOOKED, late_write_prefill, metric, node_transfer, pools_full
from tests.integration.holding_proxy import in_front_of
from tests.support import until
from tests.support.stacks import FAST_NODE, NOTICES_AT_ONCE


def rejected(service: Service, kind: str) -> float:
    return metric(service, "kvroom_messages_rejected_total", f'kind="{kind}"')


def send(port: int, frames: list[bytes], keys: CurveKeys | None, server_key: str) -> None:
    """One message from a client of our own making; with ``keys`` None, a client without CURVE."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    if keys is not None:
        Security(keys).client(sock, server_key)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(frames)
    finally:
        sock.close()
        ctx.term()


@pytest.fixture
def held(stack):
    """Prefill and decode nodes, with a proxy in front of the decode holding done+aux messages."""

    def start(*decode_args: str):
        stack.bootstrap.start()
        stack.bootstrap.wait_healthy(registered=False)
        decode = stack.node("decode", "decode-0", list(decode_args))
        proxy = proxies.enter_context(in_front_of(decode, lambda m: isinstance(m, protocol.DoneAux)))
        decode.start()
        prefill = stack.node("prefill", "prefill-0", NOTICES_AT_ONCE).start()
        decode.wait_healthy()
        prefill.wait_healthy()
        return prefill, decode, proxy

    import contextlib

    with contextlib.ExitStack() as proxies:
        yield start


def test_forged_reports_change_nothing(stack, held, model):
    prefill, decode, proxy = held()
    boot = stack.bootstrap
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "forge me", "max_new_tokens": 6}).json()["room"]
        until(lambda: proxy.held_rooms() == {room}, 20, "the done+aux held")
        forged = protocol.encode(
            protocol.RoomReports(
                "decode-0",
                [
                    protocol.RoomStatus(
                        transfer=room,
                        state=4,
                        output_ids=[33, 33, 33, 33],
                        outcome="completed",
                        finish_reason="length",
                    )
                ],
            )
        )
        boot_key = boot.keys.public
        send(boot.zmq_port, forged, None, boot_key)  # no CURVE: never delivered
        send(boot.zmq_port, forged, CurveKeys.generate(), boot_key)  # a stranger's key
        send(boot.zmq_port, forged, prefill.keys, boot_key)  # a member, naming another node
        until(lambda: rejected(boot, "unauthorized") == 2, 10, "both forgeries refused")
        for _ in range(5):
            body = client.get(f"/rooms/{room}").json()
            assert (body["state"], body["finished"], body["output_ids"]) == ("TRANSFERRING", False, None)
        proxy.release()
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert final["state"] == "SUCCESS" and final["outcome"] == "completed"
        assert final["output_ids"] == generate(model, encode_text("forge me"), 6)
    until(lambda: pools_full(prefill, decode), 10, "pools full")


def test_a_decode_that_raises_is_failed_everywhere_and_counted(stack, model):
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    env = {"KVROOM_TEST_HOOK": "break-decode", "KVROOM_TEST_ROLE": "decode"}
    decode = stack.node("decode", "decode-0", module=HOOKED, env=env).start()
    prefill = stack.node("prefill", "prefill-0").start()
    decode.wait_healthy()
    prefill.wait_healthy()
    with stack.client() as client:
        broken = client.post(
            "/rooms", json={"prompt": "x" * 13, "max_new_tokens": 5}, params={"wait": 20}
        ).json()
        assert (broken["state"], broken["reason"], broken["output_ids"]) == ("FAILED", "decode_failed", None)
        assert broken["transfer_state"] == "SUCCESS" and broken["outcome"] == "failed"
        until(lambda: node_transfer(decode, broken["room"])["outcome"] == "failed", 10, "the decode's view")
        assert node_transfer(decode, broken["room"])["state"] == "FAILED"
        fine = client.post(
            "/rooms", json={"prompt": "y" * 14, "max_new_tokens": 5}, params={"wait": 20}
        ).json()
        assert fine["state"] == "SUCCESS" and fine["output_ids"] == generate(model, encode_text("y" * 14), 5)
    for service in (stack.bootstrap, decode):
        assert metric(service, "kvroom_room_failures_total", 'reason="decode_failed"') == 1, service.name
    until(lambda: pools_full(prefill, decode), 10, "pools full")


def test_a_late_write_lands_only_in_fenced_pages(stack, model, tmp_path):
    stack.bootstrap.args += ["--max-attempts", "1"]  # the room ends with the write that gave up
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    release = tmp_path / "release-the-write"
    prefill = late_write_prefill(stack, "prefill-0", ["--write-timeout-s", "1"], release).start()
    decode = stack.node("decode", "decode-0", ["--lease-timeout-s", "60"]).start()
    prefill.wait_healthy()
    decode.wait_healthy()
    with stack.client() as client:
        late = "late " * 30
        body = client.post("/rooms", json={"prompt": late, "max_new_tokens": 4}, params={"wait": 20}).json()
        assert (body["state"], body["reason"]) == ("FAILED", "transfer_timeout")
        # The write gave up but may still move: the decode's pages stay lent, the prefill's stay read.
        assert decode.health()["fenced_rooms"] == 1
        assert prefill.health()["fenced_rooms"] == 1
        # A long room takes the first free pages, which would be the lent ones were they free;
        # the held write moves for real while it decodes.
        long = client.post("/rooms", json={"prompt": "long", "max_new_tokens": 400}).json()["room"]
        until(lambda: node_transfer(decode, long)["state"] == "SUCCESS", 20, "the long room to decode")
        release.touch()
        final = client.get(f"/rooms/{long}", params={"wait": 30}).json()
        assert final["state"] == "SUCCESS" and final["output_ids"] == generate(
            model, encode_text("long"), 400
        )
        # The engine said the late write finished: only now are the lent pages free again.
        until(lambda: decode.health()["fenced_rooms"] == 0, 30, "the fence lifted after the write ended")
        assert "the write that gave up has ended" in prefill.log_path.read_text()
        prompts = [f"after the late write {i} " * (1 + i % 4) for i in range(50)]

        async def rooms() -> list[dict]:
            async with httpx.AsyncClient(base_url=stack.bootstrap.url, timeout=60) as c:
                made = [await c.post("/rooms", json={"prompt": p, "max_new_tokens": 6}) for p in prompts]
                return [(await c.get(f"/rooms/{r.json()['room']}", params={"wait": 30})).json() for r in made]

        for prompt, final in zip(prompts, asyncio.run(rooms()), strict=True):
            assert final["state"] == "SUCCESS", final
            assert final["output_ids"] == generate(model, encode_text(prompt), 6)
        until(lambda: pools_full(prefill, decode), 10, "pools full")


def flipped(frames: list[bytes], byte: int) -> list[bytes]:
    record = bytearray(frames[2])
    record[byte] ^= 0x01
    return [frames[0], frames[1], bytes(record)]


def test_no_changed_aux_byte_ever_gives_success(stack, held, model):
    prefill, decode, proxy = held("--aux-timeout-s", "1")
    with stack.client() as client:
        rooms = [
            client.post("/rooms", json={"prompt": f"flip {i}", "max_new_tokens": 4}).json()["room"]
            for i in range(24)
        ]
        until(lambda: proxy.held_rooms() == set(rooms), 30, "every done+aux held")
        for byte, room in enumerate(rooms):
            proxy.inject(flipped(proxy.held_for(room), byte))
            proxy.drop(room)  # the intact copy never comes
        for room in rooms:
            final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
            assert (final["state"], final["reason"], final["output_ids"]) == ("FAILED", "aux_timeout", None)
        assert rejected(decode, "aux_corrupt") == 24

        # A changed copy that comes first does not win: the intact one decides.
        room = client.post("/rooms", json={"prompt": "tampered first", "max_new_tokens": 6}).json()["room"]
        until(lambda: proxy.held_rooms() == {room}, 20, "the done+aux held")
        proxy.inject(flipped(proxy.held_for(room), 8))  # the first token
        until(lambda: rejected(decode, "aux_corrupt") == 25, 10, "the changed copy refused")
        proxy.release()
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert final["state"] == "SUCCESS"
        assert final["output_ids"] == generate(model, encode_text("tampered first"), 6)
    until(lambda: pools_full(prefill, decode), 10, "pools full")


@pytest.mark.parametrize("page", ["0", "-1"])
def test_a_changed_kv_byte_is_kv_corrupt(stack, model, page):
    """A byte changed in the first or the last page of a room of several pages."""
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    env = {"KVROOM_TEST_HOOK": "corrupt-kv", "KVROOM_TEST_ROLE": "decode", "KVROOM_TEST_CORRUPT_PAGE": page}
    decode = stack.node("decode", "decode-0", module=HOOKED, env=env).start()
    prefill = stack.node("prefill", "prefill-0").start()
    decode.wait_healthy()
    prefill.wait_healthy()
    with stack.client() as client:
        final = client.post(
            "/rooms", json={"prompt": "bit rot " * 12, "max_new_tokens": 4}, params={"wait": 20}
        ).json()
        assert (final["state"], final["reason"], final["output_ids"]) == ("FAILED", "kv_corrupt", None)
    assert metric(decode, "kvroom_room_failures_total", 'reason="kv_corrupt"') == 1
    until(lambda: pools_full(prefill, decode), 10, "pools full")


def test_sigterm_drains_one_of_two_decode_nodes(fast_stack, model):
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0", FAST_NODE).start()
    staying = stack.node("decode", "decode-a", FAST_NODE).start()
    leaving = stack.node("decode", "decode-b", FAST_NODE).start()
    for node in (prefill, staying, leaving):
        node.wait_healthy()
    prompts = [f"drain {i} " * (2 + i % 3) for i in range(32)]
    tokens = 120  # long enough that rooms are still decoding when the signal comes

    async def run() -> tuple[list[dict], list[dict]]:
        async with httpx.AsyncClient(base_url=stack.bootstrap.url, timeout=60) as c:
            before = [
                (await c.post("/rooms", json={"prompt": p, "max_new_tokens": tokens})).json()
                for p in prompts[:16]
            ]
            assert {r["decode"]["node_id"] for r in before} == {"decode-a", "decode-b"}
            leaving.proc.send_signal(signal.SIGTERM)
            heard_by = time.monotonic() + 10
            while True:  # until the bootstrap heard: from then on nothing is placed there
                nodes = {n["node_id"]: n for n in (await c.get("/nodes")).json()}
                if "decode-b" not in nodes or nodes["decode-b"]["draining"]:
                    break
                assert time.monotonic() < heard_by, (nodes, leaving.log_tail(40))
                await asyncio.sleep(0.01)
            after = [
                (await c.post("/rooms", json={"prompt": p, "max_new_tokens": tokens})).json()
                for p in prompts[16:]
            ]
            waits = [c.get(f"/rooms/{r['room']}", params={"wait": 50}) for r in before + after]
            finals = [resp.json() for resp in await asyncio.gather(*waits)]  # 50 s at most, not 50 s a room
            return after, finals

    after, finals = asyncio.run(run())
    assert {r["decode"]["node_id"] for r in after} == {"decode-a"}
    for prompt, final in zip(prompts, finals, strict=True):
        assert final["finished"], final
        if final["decode"]["node_id"] == "decode-a":
            assert final["state"] == "SUCCESS"
        if final["state"] == "SUCCESS":
            assert final["output_ids"] == generate(model, encode_text(prompt), tokens)
        else:
            assert final["reason"], final
    leaving.proc.wait(30)
    assert leaving.proc.returncode == 0
    log = leaving.log_path.read_text()
    assert "told the bootstrap this node drains" in log
    nodes = {n["node_id"] for n in httpx.get(f"{stack.bootstrap.url}/nodes").json()}
    assert nodes == {"prefill-0", "decode-a"}  # it left once its rooms ended
    until(lambda: pools_full(prefill, staying), 10, "pools full")


def test_health_is_503_until_registered_and_a_refusal_backs_off(stack):
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    outsider = stack.node("decode", "decode-x", ["--join-token", "not-the-cluster-s"]).start()

    def refused() -> dict | None:
        try:
            resp = httpx.get(f"{outsider.url}/health", timeout=2)
        except httpx.HTTPError:
            return None  # not listening yet
        return resp.json() if resp.status_code == 503 and resp.json()["standing"] == "refused" else None

    body = until(refused, 30, "the refused node to say so")
    assert body["status"] == "unavailable" and "401" in body["problem"] and not body["registered"]
    until(lambda: "trying again in 2.0s" in outsider.log_path.read_text(), 30, "the pause to grow")
    log = outsider.log_path.read_text()
    assert log.count("registration refused") <= 4  # 0.5 s, 1 s, 2 s: not every half second
    assert httpx.get(f"{stack.bootstrap.url}/nodes").json() == []
