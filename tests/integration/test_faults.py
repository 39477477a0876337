"""Peers die and restart: every room ends with a reason, nothing hangs or leaks."""

import signal

import httpx

from shared.models.reference import encode_text, generate
from shared.wire import protocol
from tests.integration.helpers import late_write_prefill, metric, node_transfer, pools_full
from tests.integration.holding_proxy import in_front_of
from tests.support import until
from tests.support.stacks import FAST_NODE, NOTICES_AT_ONCE


def room_through_proxy(client, proxy, model, prompt: str, max_new_tokens: int) -> dict:
    """A new room whose held message is let through ends SUCCESS with the colocated run's tokens."""
    room = client.post("/rooms", json={"prompt": prompt, "max_new_tokens": max_new_tokens}).json()
    until(lambda: proxy.held_rooms() == {room["room"]}, 20, "the new room's held message")
    proxy.release()
    final = client.get(f"/rooms/{room['room']}", params={"wait": 20}).json()
    assert final["state"] == "SUCCESS"
    assert final["output_ids"] == generate(model, encode_text(prompt), max_new_tokens)
    return room


def test_prefill_killed_mid_transfer(fast_stack, model):
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    decode = stack.node("decode", "decode-0", [*FAST_NODE, "--transfer-timeout-s", "5"])
    # Done+aux is held: the rooms are TRANSFERRING on the decode when the prefill dies.
    with in_front_of(decode, lambda m: isinstance(m, protocol.DoneAux)) as proxy:
        decode.start()
        prefill = stack.node("prefill", "prefill-0", [*FAST_NODE, *NOTICES_AT_ONCE]).start()
        decode.wait_healthy()
        prefill.wait_healthy()
        start = decode.health()
        with stack.client() as client:
            rooms = [
                client.post("/rooms", json={"prompt": f"doomed {i}", "max_new_tokens": 4}).json()["room"]
                for i in range(3)
            ]
            until(lambda: proxy.held_rooms() == set(rooms), 20, "three rooms mid-transfer")
            until(
                lambda: all(node_transfer(decode, r)["state"] == "TRANSFERRING" for r in rooms), 10, "decode"
            )
            prefill.kill()
            for room in rooms:
                final = client.get(f"/rooms/{room}", params={"wait": 15}).json()
                assert final["state"] == "FAILED", final
                assert final["reason"] in ("peer_lost", "transfer_timeout")
                until(lambda room=room: node_transfer(decode, room)["state"] == "FAILED", 10, "decode")
            # The KV that did land is never turned into a SUCCESS afterwards: it landed in fenced
            # pages, which its done+aux gives back.
            proxy.release()
            until(lambda: metric(decode, "kvroom_late_writes_total") == 3, 10, "the late done+aux counted")
            assert all(client.get(f"/rooms/{r}").json()["state"] == "FAILED" for r in rooms)
            assert decode.health()["status"] == "ok"
            until(lambda: pools_full(decode), 10, "decode pools back to their start")
            assert decode.health()["free_pages"] == start["free_pages"]

            # A new prefill registers and new rooms succeed.
            stack.node("prefill", "prefill-1", FAST_NODE).start().wait_healthy()
            room = room_through_proxy(client, proxy, model, "survivor", 6)
            assert room["prefill"]["node_id"] == "prefill-1"


def test_decode_killed_prefill_frees_and_the_rooms_move_to_another(fast_stack, model):
    stack = fast_stack
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0", FAST_NODE)
    # Transfer requests are held: the prefill holds computed KV for rooms of the doomed decode.
    with in_front_of(prefill, lambda m: isinstance(m, protocol.TransferRequest)) as proxy:
        prefill.start()
        doomed = stack.node("decode", "decode-a", FAST_NODE).start()
        prefill.wait_healthy()
        doomed.wait_healthy()
        with stack.client() as client:
            prompts = [f"moved {i} " * 20 for i in range(3)]
            rooms = [
                client.post("/rooms", json={"prompt": p, "max_new_tokens": 4}).json()["room"] for p in prompts
            ]
            until(lambda: proxy.held_rooms() == set(rooms), 20, "three requests held")
            until(
                lambda: all(node_transfer(prefill, r)["state"] == "WAITING_FOR_INPUT" for r in rooms),
                20,
                "the prefill to hold the KV",
            )
            assert prefill.health()["free_pages"] < prefill.health()["total_pages"]
            survivor = stack.node("decode", "decode-b", FAST_NODE).start()
            survivor.wait_healthy()
            doomed.kill()
            for room in rooms:
                # The first attempt ends with the decode; the prefill frees what it held for it.
                until(lambda room=room: node_transfer(prefill, room)["reason"] == "peer_lost", 10, "prefill")
                until(
                    lambda room=room: len(client.get(f"/rooms/{room}").json()["attempts"]) == 2, 10, "again"
                )
            # The dead decode's requests are refused when they come, nothing is written for them;
            # the rooms' new requests, from the survivor, go through.
            proxy.release()
            for prompt, room in zip(prompts, rooms, strict=True):
                final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
                assert final["state"] == "SUCCESS", final
                assert final["output_ids"] == generate(model, encode_text(prompt), 4)
                first, second = final["attempts"]
                assert (first["decode"], first["state"], first["reason"]) == (
                    "decode-a",
                    "FAILED",
                    "peer_lost",
                )
                assert second["decode"] == "decode-b" and final["decode"]["node_id"] == "decode-b"
            until(
                lambda: metric(prefill, "kvroom_messages_rejected_total", 'kind="finished"') == 3,
                10,
                "the dead decode's requests refused",
            )
            nodes = {n["node_id"]: n["alive"] for n in client.get("/nodes").json()}
            assert nodes == {"prefill-0": True, "decode-a": False, "decode-b": True}
            room = room_through_proxy(client, proxy, model, "next", 5)
            assert room["decode"]["node_id"] == "decode-b"
            until(lambda: pools_full(prefill, survivor), 10, "pools full")


def test_bootstrap_restart_nodes_register_again(fast_stack, model):
    stack = fast_stack
    prefill, decode = stack.start(FAST_NODE, FAST_NODE)
    with stack.client() as client:
        first = client.post("/rooms", json={"prompt": "before", "max_new_tokens": 3}).json()["room"]
        assert client.get(f"/rooms/{first}", params={"wait": 20}).json()["state"] == "SUCCESS"
    stack.bootstrap.stop()
    stack.bootstrap.start()  # same ports, empty memory
    stack.bootstrap.wait_healthy(registered=False)

    def both_registered():
        return {n["node_id"] for n in httpx.get(f"{stack.bootstrap.url}/nodes").json()} == {
            "prefill-0",
            "decode-0",
        }

    until(both_registered, 20, "nodes to register again")
    with stack.client() as client:
        assert client.get(f"/rooms/{first}").status_code == 404
        room = client.post("/rooms", json={"prompt": "after", "max_new_tokens": 7}).json()["room"]
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert final["state"] == "SUCCESS"
        assert final["output_ids"] == generate(model, encode_text("after"), 7)
    until(lambda: pools_full(prefill, decode), 10, "pools full")


def test_a_prefill_stopped_past_its_ttl_loses_its_rooms_but_its_late_writes_land_in_fenced_pages(
    fast_stack, model, tmp_path
):
    """Silence is not death: a prefill stopped (SIGSTOP: a GC pause, a frozen VM) with a write in
    flight is taken for dead and its room fails, but the decode keeps that room's pages fenced, so
    the write, which moves once the prefill resumes, lands there and not in a later room's. KV is
    not verified: only the fence keeps the later rooms' outputs right."""
    stack = fast_stack
    stack.verify_kv = False
    stack.bootstrap.args += ["--max-attempts", "1"]  # the stopped prefill's room ends with it
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    release = tmp_path / "release-the-write"
    held = [*FAST_NODE, *NOTICES_AT_ONCE, "--write-timeout-s", "60"]
    stopped = late_write_prefill(stack, "prefill-0", held, release).start()
    decode = stack.node("decode", "decode-0", [*FAST_NODE, "--lease-timeout-s", "60"]).start()
    stopped.wait_healthy()
    decode.wait_healthy()

    def succeeded(client, prompts: list[str], max_new_tokens: int) -> None:
        made = [client.post("/rooms", json={"prompt": p, "max_new_tokens": max_new_tokens}) for p in prompts]
        for prompt, room in zip(prompts, made, strict=True):
            final = client.get(f"/rooms/{room.json()['room']}", params={"wait": 30}).json()
            assert final["state"] == "SUCCESS", final
            assert final["output_ids"] == generate(model, encode_text(prompt), max_new_tokens)

    with stack.client() as client:
        doomed = client.post("/rooms", json={"prompt": "doomed " * 30, "max_new_tokens": 4}).json()["room"]
        until(
            lambda: (node_transfer(decode, doomed) or {}).get("state") == "TRANSFERRING", 20, "a write held"
        )
        live = stack.node("prefill", "prefill-1", FAST_NODE).start()
        live.wait_healthy()
        stopped.proc.send_signal(signal.SIGSTOP)
        try:
            final = client.get(f"/rooms/{doomed}", params={"wait": 20}).json()
            assert (final["state"], final["reason"]) == ("FAILED", "peer_lost")
            assert decode.health()["fenced_rooms"] == 1 and metric(decode, "kvroom_fenced_pages") >= 2
            # The first free pages would be the doomed room's, were they free.
            long = client.post("/rooms", json={"prompt": "long", "max_new_tokens": 400}).json()["room"]
            until(lambda: node_transfer(decode, long)["state"] == "SUCCESS", 20, "the long room to decode")
            succeeded(client, [f"meanwhile {i} " * (1 + i % 3) for i in range(8)], 6)
        finally:
            release.touch()  # the held write moves for real once the prefill runs again
            stopped.proc.send_signal(signal.SIGCONT)
        final = client.get(f"/rooms/{long}", params={"wait": 30}).json()
        assert final["state"] == "SUCCESS" and final["output_ids"] == generate(
            model, encode_text("long"), 400
        )
        until(lambda: decode.health()["fenced_rooms"] == 0, 30, "the fence lifted once the write ended")
        assert metric(decode, "kvroom_late_writes_total") == 1  # its done+aux came, into fenced pages
        assert (
            metric(stack.bootstrap, "kvroom_rooms_failed_by_node_loss_total", 'evidence="missed_heartbeats"')
            == 1
        )
        stopped.wait_healthy()  # alive again: its next rooms are its own
        succeeded(client, [f"after {i} " * (1 + i % 4) for i in range(12)], 6)
    until(lambda: pools_full(stopped, live, decode), 10, "pools full")
