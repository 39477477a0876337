"""Tensor-parallel nodes: N real rank processes per node, each with its own engine, pool, socket
and aux slots; heterogeneous sizes between prefill and decode; ranks that agree before SUCCESS."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from shared.models.reference import encode_text, generate
from shared.wire import protocol
from tests.integration.helpers import metric, node_transfer
from tests.integration.holding_proxy import in_front_of
from tests.support import until
from tests.support.stacks import FAST_NODE, NOTICES_AT_ONCE

PROMPTS = [
    "a",
    "Hello, tensor parallel kvroom!",
    "0123456789abcdef",
    "long prompt spanning many pages " * 20,
    *[f"tp room {i}: " + "xyz" * i for i in range(12)],
]


def all_ranks_full(service) -> bool:
    """Every rank's pages and aux slots back, and no room left on any."""
    h = service.health()
    ranks = h["ranks"]
    return all(r.get("free_pages") == h["total_pages"] and not r.get("rooms_in_flight") for r in ranks) and (
        h["role"] == "prefill" or all(r.get("free_aux_slots") == h["total_aux_slots"] for r in ranks)
    )


async def run_rooms(url: str, prompts: list[str], tokens: int) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        made = await asyncio.gather(
            *(client.post("/rooms", json={"prompt": p, "max_new_tokens": tokens}) for p in prompts)
        )
        return list(
            await asyncio.gather(
                *(client.get(f"/rooms/{r.json()['room']}", params={"wait": 50}) for r in made)
            )
        )


@pytest.mark.parametrize(
    ("np_", "nd", "agreement"),
    [
        (1, 1, "ipc"),
        (2, 1, "ipc"),
        (1, 2, "ipc"),
        (2, 2, "ipc"),
        (2, 4, "ipc"),
        (4, 2, "ipc"),
        (2, 2, "gloo"),
    ],
)
def test_tokens_equal_the_colocated_single_rank_run(stack, model, np_, nd, agreement):
    """Every shape of ranks; the ranks agree over the leader's ipc sockets or a gloo all-reduce."""
    prefill, decode = stack.start(
        ["--tp-size", str(np_), "--agreement", agreement], ["--tp-size", str(nd), "--agreement", agreement]
    )
    assert (prefill.health()["tp_size"], decode.health()["tp_size"]) == (np_, nd)
    sessions = {r["session_id"] for s in (prefill, decode) for r in s.health()["ranks"]}
    assert len(sessions) == np_ + nd  # an engine per rank
    finals = [r.json() for r in asyncio.run(run_rooms(stack.bootstrap.url, PROMPTS, 8))]
    for prompt, final in zip(PROMPTS, finals, strict=True):
        assert final["state"] == "SUCCESS", final
        assert final["output_ids"] == generate(model, encode_text(prompt), 8)
    nodes = {n["node_id"]: n for n in httpx.get(f"{stack.bootstrap.url}/nodes").json()}
    assert nodes["decode-0"]["tp_size"] == nd and len(nodes["decode-0"]["ranks"]) == nd
    until(lambda: all_ranks_full(prefill) and all_ranks_full(decode), 15, "every rank's pools full")


@pytest.fixture
def tp_decode(stack):
    """A prefill of one rank, a decode of two behind a proxy that holds rank 1's done+aux."""

    def start(*decode_args: str):
        stack.bootstrap.start()
        stack.bootstrap.wait_healthy(registered=False)
        decode = stack.node("decode", "decode-0", ["--tp-size", "2", *decode_args])
        hold = lambda m: isinstance(m, protocol.DoneAux) and m.rank == 1  # noqa: E731
        proxy = proxies.enter_context(in_front_of(decode, hold, ranks=2))
        decode.start()
        prefill = stack.node("prefill", "prefill-0", NOTICES_AT_ONCE).start()
        decode.wait_healthy()
        prefill.wait_healthy()
        return prefill, decode, proxy

    import contextlib

    with contextlib.ExitStack() as proxies:
        yield start


@pytest.mark.parametrize("landing", ["without its aux", "into a zeroed slot"])
def test_one_ranks_aux_held_back_keeps_every_rank_from_success(stack, tp_decode, model, landing):
    prefill, decode, proxy = tp_decode()
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "the race", "max_new_tokens": 6}).json()["room"]
        until(lambda: proxy.held_rooms() == {room}, 20, "rank 1's done+aux held")
        frames = proxy.held_for(room)
        # Rank 1 learns its KV is done, but its slot holds no record of this room.
        proxy.inject(frames[:2] if landing == "without its aux" else [frames[0], frames[1], bytes(24)])
        until(
            lambda: any(p[0] == 0 and isinstance(p[1], protocol.DoneAux) for p in proxy.passed),
            10,
            "rank 0's",
        )
        until(lambda: node_transfer(prefill, room)["state"] == "SUCCESS", 10, "the prefill to finish")
        for _ in range(20):  # rank 0 is ready on its own; the agreed state is not SUCCESS
            assert node_transfer(decode, room)["state"] == "TRANSFERRING"
            assert client.get(f"/rooms/{room}").json()["state"] == "TRANSFERRING"
        assert metric(decode, "kvroom_room_transitions_total", 'state="SUCCESS"') == 0
        assert decode.running and decode.health()["status"] == "ok"
        proxy.release()  # the record lands: both ranks are ready, and agree
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert final["state"] == "SUCCESS" and final["output_ids"] == generate(
            model, encode_text("the race"), 6
        )
    until(lambda: all_ranks_full(decode), 10, "every rank's pools full")


def test_an_aux_that_never_lands_fails_every_rank(stack, tp_decode):
    _, decode, proxy = tp_decode("--aux-timeout-s", "1")
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "never lands", "max_new_tokens": 4}).json()["room"]
        until(lambda: proxy.held_rooms() == {room}, 20, "rank 1's done+aux held")
        proxy.inject(proxy.held_for(room)[:2])
        proxy.drop(room)
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert (final["state"], final["reason"]) == ("FAILED", "aux_timeout")
        assert node_transfer(decode, room)["reason"] == "aux_timeout"
    until(lambda: all_ranks_full(decode), 10, "every rank's pools full")


@pytest.mark.parametrize(
    ("role", "held"), [("decode", protocol.DoneAux), ("prefill", protocol.TransferRequest)]
)
def test_a_killed_rank_breaks_its_node_and_rooms_move_on(fast_stack, model, role, held):
    """With --stay-up-on-rank-death (for debugging) the broken node stays, unhealthy, and frees what
    its live rank held."""
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    other = "prefill" if role == "decode" else "decode"
    broken = stack.node(role, f"{role}-tp", [*FAST_NODE, "--tp-size", "2", "--stay-up-on-rank-death"])
    # What the broken node waits for is held, so its rooms are mid-flight when its rank dies.
    with in_front_of(broken, lambda m: isinstance(m, held), ranks=2) as proxy:
        broken.start()
        peer = stack.node(other, f"{other}-0", FAST_NODE).start()
        broken.wait_healthy()
        peer.wait_healthy()
        with stack.client() as client:
            rooms = [
                client.post("/rooms", json={"prompt": f"doomed {i}", "max_new_tokens": 5}).json()["room"]
                for i in range(3)
            ]
            until(lambda: proxy.held_rooms() == set(rooms), 20, "the rooms mid-flight")
            healthy = stack.node(role, f"{role}-one", FAST_NODE).start()
            healthy.wait_healthy()
            rank1 = next(r for r in broken.health()["ranks"] if r["rank"] == 1)
            os.kill(rank1["pid"], signal.SIGKILL)
            for room in rooms:
                # The room's attempt on the broken node ends peer_lost; it is placed again on the
                # healthy node, where it succeeds.
                final = client.get(f"/rooms/{room}", params={"wait": 30}).json()
                first = final["attempts"][0]
                assert (first["state"], first["reason"], first[role]) == ("FAILED", "peer_lost", broken.name)
                assert final["state"] == "SUCCESS" and final[role]["node_id"] == healthy.name, final
            health = httpx.get(f"{broken.url}/health").json()
            assert health["status"] == "unavailable" and "rank 1" in health["problem"]
            assert [r["alive"] for r in health["ranks"]] == [True, False]
            proxy.release()  # whatever comes late changes nothing
            # The surviving rank gave back every page it held.
            full = broken.health()["total_pages"]
            until(lambda: broken.health()["ranks"][0]["free_pages"] == full, 15, "rank 0's pages back")
            # The node said so at once, not at its next heartbeat.
            until(
                lambda: (
                    not next(n for n in client.get("/nodes").json() if n["node_id"] == broken.name)["healthy"]
                ),
                2,
                "the bootstrap to hear the node is broken",
            )
            after = [
                client.post("/rooms", json={"prompt": f"after {i}", "max_new_tokens": 5}).json()
                for i in range(4)
            ]
            assert {r[role]["node_id"] for r in after} == {healthy.name}
            for i, r in enumerate(after):
                final = client.get(f"/rooms/{r['room']}", params={"wait": 20}).json()
                assert final["state"] == "SUCCESS"
                assert final["output_ids"] == generate(model, encode_text(f"after {i}"), 5)


def test_a_prefill_that_loses_a_rank_leaves_and_exits_and_its_decode_frees_at_once(fast_stack, model):
    """A rank's death is certain: the prefill node fails its rooms, leaves the cluster and exits 1;
    its decode frees the pages it had lent at once, not after the 60 s lease."""
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    broken = stack.node("prefill", "prefill-tp", [*FAST_NODE, "--tp-size", "2"])
    decode = stack.node("decode", "decode-tp", [*FAST_NODE, "--tp-size", "2"]).start()
    # The decode's transfer requests are held: the rooms are mid-flight, their pages lent.
    with in_front_of(broken, lambda m: isinstance(m, protocol.TransferRequest), ranks=2) as proxy:
        broken.start()
        broken.wait_healthy()
        decode.wait_healthy()
        prompts = [f"doomed {i} " * (1 + i) for i in range(4)]
        with stack.client() as client:
            rooms = [
                client.post("/rooms", json={"prompt": p, "max_new_tokens": 5}).json()["room"] for p in prompts
            ]
            until(lambda: proxy.held_rooms() == set(rooms), 20, "the rooms mid-flight")
            assert decode.health()["free_pages"] < decode.health()["total_pages"]
            healthy = stack.node("prefill", "prefill-one", FAST_NODE).start()
            healthy.wait_healthy()
            rank1 = next(r for r in broken.health()["ranks"] if r["rank"] == 1)
            os.kill(rank1["pid"], signal.SIGKILL)
            assert broken.proc.wait(10) == 1  # for its supervisor to start it again
            assert broken.name not in {n["node_id"] for n in client.get("/nodes").json()}  # it left
            for prompt, room in zip(prompts, rooms, strict=True):
                final = client.get(f"/rooms/{room}", params={"wait": 30}).json()
                assert final["attempts"][0]["reason"] == "peer_lost", final
                assert final["state"] == "SUCCESS" and final["prefill"]["node_id"] == healthy.name, final
                assert final["output_ids"] == generate(model, encode_text(prompt), 5)
            until(lambda: all_ranks_full(decode), 5, "every decode rank's pages and slots back")
            # What the operator sees: why the node left, and the lent pages freed on its certain
            # death rather than at the lease's end.
            assert metric(stack.bootstrap, "kvroom_nodes_left_total", 'cause="rank_death"') == 1
            assert metric(decode, "kvroom_lent_pages_closed_total", 'how="revoked"') > 0
            assert metric(decode, "kvroom_lent_pages_closed_total", 'how="expired"') == 0
            results = asyncio.run(run_rooms(stack.bootstrap.url, [f"after {i}" for i in range(4)], 5))
            for i, final in enumerate(results):
                assert final.json()["state"] == "SUCCESS"
                assert final.json()["output_ids"] == generate(model, encode_text(f"after {i}"), 5)


def test_a_decode_that_loses_a_rank_exits_and_its_supervisor_brings_it_back_as_a_new_incarnation(
    fast_stack, model
):
    """A TP 4 decode whose rank 2 is killed mid-stream exits 1 within seconds, is gone from the
    bootstrap's list at once, and, started again as a supervisor would, serves rooms again."""
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0", FAST_NODE).start()
    decode = stack.node("decode", "decode-tp4", [*FAST_NODE, "--tp-size", "4"]).start()
    prefill.wait_healthy()
    decode.wait_healthy()
    with stack.client() as client:
        first = {n["node_id"]: n for n in client.get("/nodes").json()}[decode.name]
        prompts = [f"streaming {i}" for i in range(4)]
        rooms = [
            client.post("/rooms", json={"prompt": p, "max_new_tokens": 200}).json()["room"] for p in prompts
        ]
        until(lambda: client.get(f"/rooms/{rooms[0]}").json()["state"] == "SUCCESS", 30, "a room decoding")
        rank2 = next(r for r in decode.health()["ranks"] if r["rank"] == 2)
        os.kill(rank2["pid"], signal.SIGKILL)
        killed = time.monotonic()
        assert decode.proc.wait(10) == 1
        print(f"the broken decode exited {time.monotonic() - killed:.1f}s after its rank died")
        assert decode.name not in {n["node_id"] for n in client.get("/nodes").json()}
        for prompt, room in zip(prompts, rooms, strict=True):
            final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
            if final["state"] == "FAILED":
                assert final["reason"], final
            else:
                assert final["output_ids"] == generate(model, encode_text(prompt), 200), final
        decode.start()  # what Docker's restart policy, systemd or Kubernetes does
        decode.wait_healthy()
        again = {n["node_id"]: n for n in client.get("/nodes").json()}[decode.name]
        assert [r["session_id"] for r in again["ranks"]] != [r["session_id"] for r in first["ranks"]]
        final = client.post(
            "/rooms", json={"prompt": "back again", "max_new_tokens": 6}, params={"wait": 30}
        ).json()
        assert final["state"] == "SUCCESS" and final["decode"]["node_id"] == decode.name
        assert final["output_ids"] == generate(model, encode_text("back again"), 6)
