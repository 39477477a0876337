"""Operating a real cluster: Redis behind the bootstrap, two bootstraps, node loss, placement by capacity.

Real processes on 127.0.0.1, the real engine, a real redis-server.
"""

import asyncio
import json
import shutil
import subprocess

import httpx
import pytest

from shared.models.reference import encode_text, generate
from shared.wire import protocol
from tests.integration.helpers import metric, node_transfer, pools_full
from tests.integration.holding_proxy import in_front_of
from tests.integration.test_store_contract import Heard
from tests.support import until, until_async
from tests.support.stacks import FAST_BOOTSTRAP, FAST_NODE


def registrations(node) -> int:
    return node.log_path.read_text().count("registered with")


async def post_all(url: str, prompts: list[str], tokens: int, in_flight: int = 32) -> list[dict]:
    """Every prompt as a room, ``in_flight`` at a time; each room's answer once it finished."""
    gate = asyncio.Semaphore(in_flight)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:

        async def one(prompt: str) -> dict:
            async with gate:
                made = (await client.post("/rooms", json={"prompt": prompt, "max_new_tokens": tokens})).json()
                for _ in range(20):
                    body = (await client.get(f"/rooms/{made['room']}", params={"wait": 30})).json()
                    if body["finished"]:
                        return body
                raise AssertionError(f"room {made['room']} never finished: {body}")

        return list(await asyncio.gather(*(one(p) for p in prompts)))


@pytest.mark.parametrize("outage", ["brief", "past the node leases"])
def test_rooms_survive_a_bootstrap_killed_and_restarted(tmp_path, redis, model, outage):
    import redis as redis_client

    from launcher.local_stack import LocalStack

    with LocalStack(tmp_path / "logs", bootstrap_args=["--store", redis.url, *FAST_BOOTSTRAP]) as stack:
        prefill, decode = stack.start(FAST_NODE, FAST_NODE)
        prompts = [f"survive the restart {i} " * (1 + i % 3) for i in range(32)]
        with stack.client() as client:
            rooms = [
                client.post("/rooms", json={"prompt": p, "max_new_tokens": 40}).json()["room"]
                for p in prompts
            ]
            stack.bootstrap.kill()
            if outage != "brief":  # no bootstrap renewed the nodes' leases: Redis let them expire
                store = redis_client.Redis.from_url(redis.url)
                leases = ("kvroom:lease:prefill-0", "kvroom:lease:decode-0")
                until(lambda: not store.exists(*leases), 15, "the leases to expire")
                store.close()
            stack.bootstrap.start()  # same ports, same key; what it knew is in Redis
            stack.bootstrap.wait_healthy(registered=False)
            for prompt, room in zip(prompts, rooms, strict=True):
                final = client.get(f"/rooms/{room}", params={"wait": 30}).json()
                assert final["finished"], final
                if final["state"] == "SUCCESS":
                    assert final["output_ids"] == generate(model, encode_text(prompt), 40)
                else:
                    assert final["reason"], final
            ends = [(v["state"], v["reason"]) for v in (client.get(f"/rooms/{r}").json() for r in rooms)]
            assert sum(state == "SUCCESS" for state, _ in ends) >= 16, ends
        assert registrations(prefill) == registrations(decode) == 1  # they never had to register again
        # Leases that ran out while no bootstrap answered are not taken for dead nodes.
        assert "marked dead" not in stack.bootstrap.log_path.read_text()
        until(lambda: pools_full(prefill, decode), 15, "pools full")


def test_two_bootstraps_share_one_redis(tmp_path, redis, model):
    from launcher.local_stack import LocalStack

    with LocalStack(tmp_path / "logs", bootstrap_args=["--store", redis.url]) as stack:
        other = stack._service("bootstrap-b", "bootstrap", ["--store", redis.url])
        stack.bootstrap.start()
        other.start()
        stack.bootstrap.wait_healthy(registered=False)
        other.wait_healthy(registered=False)
        prefill, decode = stack.node("prefill", "prefill-0").start(), stack.node("decode", "decode-0").start()
        prefill.wait_healthy()
        decode.wait_healthy()
        prompts = [f"two bootstraps {i}" for i in range(200)]

        async def run() -> list[dict]:
            async with (
                httpx.AsyncClient(base_url=stack.bootstrap.url, timeout=60) as a,
                httpx.AsyncClient(base_url=other.url, timeout=60) as b,
            ):
                gate = asyncio.Semaphore(16)

                async def one(i: int) -> dict:
                    async with gate:
                        placed = await (a, b)[i % 2].post(
                            "/rooms", json={"prompt": prompts[i], "max_new_tokens": 4}
                        )
                        room = placed.json()["room"]
                        body = (await (b, a)[i % 2].get(f"/rooms/{room}", params={"wait": 30})).json()
                        again = (await (a, b)[i % 2].get(f"/rooms/{room}")).json()
                        assert again["state"] == body["state"]
                        return body

                return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

        for prompt, final in zip(prompts, asyncio.run(run()), strict=True):
            assert final["state"] == "SUCCESS", final
            assert final["output_ids"] == generate(model, encode_text(prompt), 4)
        ids = {n["node_id"] for n in httpx.get(f"{other.url}/nodes").json()}
        assert ids == {"prefill-0", "decode-0"}  # registered through one, known to both


def test_a_bootstrap_without_redis_is_unhealthy_and_recovers(tmp_path, redis, model):
    from launcher.local_stack import LocalStack

    with LocalStack(tmp_path / "logs", bootstrap_args=["--store", redis.url]) as stack:
        stack.start(FAST_NODE, FAST_NODE)
        with stack.client() as client:
            kept = client.post(
                "/rooms", json={"prompt": "kept", "max_new_tokens": 4}, params={"wait": 20}
            ).json()
            assert kept["state"] == "SUCCESS"
            redis.stop()
            until(lambda: client.get("/health").status_code == 503, 10, "the bootstrap to say so")
            assert "redis" in client.get("/health").json()["problem"]
            refused = client.post("/rooms", json={"prompt": "refused", "max_new_tokens": 4})
            assert refused.status_code == 503
            assert stack.bootstrap.running
            redis.start()  # the same data directory: what Redis kept is back
            until(lambda: client.get("/health").status_code == 200, 20, "the bootstrap to recover")
            assert client.get(f"/rooms/{kept['room']}").json()["state"] == "SUCCESS"
            until(lambda: client.get("/health").json()["live_decode_nodes"] == 1, 10, "nodes back")
            after = client.post(
                "/rooms", json={"prompt": "after", "max_new_tokens": 4}, params={"wait": 20}
            ).json()
            assert after["state"] == "SUCCESS" and after["output_ids"] == generate(
                model, encode_text("after"), 4
            )


def test_the_event_channel_back_after_redis_restarts_wakes_every_waiter(redis):
    """A room changed while the subscription was down is heard by nobody: once the channel is back,
    every waiter is woken to read its room again, so a ``?wait`` does not sit out its whole time."""
    import redis.asyncio as aioredis

    from bootstrap.redis_store import RedisStore

    async def run() -> None:
        heard = Heard()
        store = RedisStore(redis.url, history=10, room_ttl_s=60, events=heard)
        await store.start()
        try:
            await until_async(lambda: heard.resyncs, 20, "the first subscription")
            redis.stop()
            redis.start()
            await until_async(lambda: heard.resyncs == 2, 20, "the subscription after the restart")
            async with aioredis.from_url(redis.url) as other:  # another bootstrap changes room 7
                await other.publish("kvroom:events", "7")
            await until_async(lambda: heard.rooms == [7], 20, "the event")
        finally:
            await store.close()

    asyncio.run(run())


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_node_killed_in_a_two_by_two_cluster(fast_stack, model, role):
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    nodes = {
        name: stack.node(name.split("-")[0], name, FAST_NODE).start()
        for name in ("prefill-a", "prefill-b", "decode-a", "decode-b")
    }
    for node in nodes.values():
        node.wait_healthy()
    victim = nodes[f"{role}-b"]
    prompts = [f"cluster room {i} " * (1 + i % 4) for i in range(400)]

    async def run() -> list[dict]:
        results: list[dict] = []
        first, rest = prompts[:133], prompts[133:]
        task = asyncio.create_task(post_all(stack.bootstrap.url, first, 8))
        await asyncio.sleep(0)  # let the first third start
        results += await task
        victim.kill()
        results += await post_all(stack.bootstrap.url, rest, 8)
        return results

    finals = asyncio.run(run())
    for prompt, final in zip(prompts, finals, strict=True):
        assert final["finished"], final
        if final["state"] == "SUCCESS":
            assert final["output_ids"] == generate(model, encode_text(prompt), 8)
        else:
            assert final["reason"], final
    after = finals[133 + 32 :]  # posted once the bootstrap had seen the node go
    assert all(f[role]["node_id"] != victim.name for f in after)
    assert all(f["state"] == "SUCCESS" for f in after)
    replaced = [f for f in finals if len(f["attempts"]) == 2]
    if role == "prefill":
        # A room whose prefill died is placed again, and succeeds.
        assert all(f["state"] == "SUCCESS" and f["attempts"][0]["prefill"] == victim.name for f in replaced)
    # Silence is no proof that the killed node writes no more: its peers may keep pages fenced
    # for it until their lease ends. Started again (as its supervisor would), it is a new process
    # under its id, and they free them at once.
    victim.start().wait_healthy()
    survivors = [n for n in nodes.values() if n is not victim]
    until(lambda: pools_full(*survivors), 15, "the survivors' pools full")


def test_rooms_go_where_there_is_room_and_wait_when_there_is_none(stack, model):
    stack.bootstrap.args += ["--queue-limit", "2", "--max-wait-s", "20"]
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0")
    small = stack.node("decode", "decode-small", ["--num-pages", "8"])
    big = stack.node("decode", "decode-big", ["--num-pages", "64"])
    # The prefill's transfer requests are held: rooms keep their pages until let through.
    with in_front_of(prefill, lambda m: isinstance(m, protocol.TransferRequest)) as proxy:
        for node in (prefill, small, big):
            node.start()
        for node in (prefill, small, big):
            node.wait_healthy()
        body = {"prompt": "p" * 100, "max_new_tokens": 60}  # 10 pages: never on the small decode
        with stack.client() as client:
            rooms = [client.post("/rooms", json=body).json() for _ in range(6)]  # 60 of the big one's 64
            assert {r["decode"]["node_id"] for r in rooms} == {"decode-big"}
            until(lambda: proxy.held_rooms() == {r["room"] for r in rooms}, 20, "the rooms to hold pages")

        async def queue() -> list[dict]:
            async with httpx.AsyncClient(base_url=stack.bootstrap.url, timeout=60) as c:
                queued = [asyncio.create_task(c.post("/rooms", json=body)) for _ in range(2)]
                while (await c.get("/health")).json()["queued_rooms"] < 2:
                    await asyncio.sleep(0.02)
                refused = await c.post("/rooms", json=body)  # beyond the queue: come back later
                assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
                assert not any(q.done() for q in queued)
                while not all(q.done() for q in queued):  # let every request through, as they come
                    proxy.release()
                    await asyncio.sleep(0.05)
                placed = [q.result().json() for q in queued]
                finals = []
                for r in [*rooms, *placed]:
                    while True:
                        proxy.release()
                        final = (await c.get(f"/rooms/{r['room']}", params={"wait": 0.2})).json()
                        if final["finished"]:
                            finals.append(final)
                            break
                return finals

        finals = asyncio.run(queue())
        assert [f["state"] for f in finals] == ["SUCCESS"] * 8
        assert metric(stack.bootstrap, "kvroom_room_failures_total", 'reason="no_capacity"') == 0
        assert metric(small, "kvroom_room_failures_total", 'reason="no_capacity"') == 0


def test_room_ids_survive_a_float64_json_parser(stack):
    stack.start()
    with stack.client() as client:
        raw = client.post("/rooms", json={"prompt": "jq", "max_new_tokens": 2}, params={"wait": 20}).text
        room = json.loads(raw)["room"]
        assert int(json.loads(raw, parse_int=float)["room"]) == room  # JavaScript, jq 1.6
        if shutil.which("jq"):
            out = subprocess.run(["jq", ".room"], input=raw, capture_output=True, text=True, check=True)
            assert int(out.stdout) == room
        assert client.get(f"/rooms/{int(float(room))}").json()["state"] == "SUCCESS"


def test_nodes_end_the_rooms_a_restarted_bootstrap_forgot(stack):
    """The memory store forgets on restart: the nodes' sweep ends what nobody will read (orphaned)."""
    slow = ["--bootstrap-timeout-s", "60", "--waiting-timeout-s", "60"]  # only the sweep ends the room
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0", [*FAST_NODE, "--waiting-timeout-s", "60"])
    # The transfer request is held: the room waits on both nodes for as long as the test likes.
    with in_front_of(prefill, lambda m: isinstance(m, protocol.TransferRequest)) as proxy:
        prefill.start()
        decode = stack.node("decode", "decode-0", [*FAST_NODE, *slow]).start()
        prefill.wait_healthy()
        decode.wait_healthy()
        with stack.client() as client:
            room = client.post("/rooms", json={"prompt": "forgotten", "max_new_tokens": 4}).json()["room"]
            until(lambda: proxy.held_rooms() == {room}, 20, "the room in flight")
            stack.bootstrap.kill()
            stack.bootstrap.start()
            stack.bootstrap.wait_healthy(registered=False)
            assert client.get(f"/rooms/{room}").status_code == 404  # forgotten
            for node in (prefill, decode):
                until(lambda node=node: node_transfer(node, room)["state"] == "FAILED", 30, "the sweep")
                assert node_transfer(node, room)["reason"] == "orphaned"
            until(lambda: pools_full(prefill, decode), 10, "pools full")
            assert registrations(prefill) == registrations(decode) == 2  # they had to register again
        proxy.release()
