"""Drain without a gap: SIGTERM to one of two decode nodes while rooms keep coming.

A room placed on the node in the moment after the signal, before the bootstrap
heard that it drains, is refused there and placed on the other node: no room
posted after the signal fails for the drain. The node exits within its grace
period and a little teardown.
"""

import signal
import threading
import time

import httpx

from shared.models.reference import encode_text, generate
from tests.integration.helpers import pools_full
from tests.support import until
from tests.support.stacks import FAST_NODE

GRACE_S = 2.0
TEARDOWN_S = 2.5  # stopping the HTTP server, the transfer thread and the engine
WAIT_S = 60  # for a room to end; the client waits longer, so a slow room is an assertion, not a timeout


def start_nodes(stack):
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    node_args = [*FAST_NODE, "--drain-grace-s", str(GRACE_S)]
    prefill = stack.node("prefill", "prefill-0", node_args).start()
    staying = stack.node("decode", "decode-a", node_args).start()
    leaving = stack.node("decode", "decode-b", node_args).start()
    for node in (prefill, staying, leaving):
        node.wait_healthy()
    exited: list[float] = []  # when the draining node's process ended

    def watch() -> None:
        leaving.proc.wait()
        exited.append(time.monotonic())

    threading.Thread(target=watch, daemon=True).start()
    return prefill, staying, leaving, exited


def check_exit(leaving, exited, signalled):
    """The node's process ended by itself, cleanly, within its grace period and a little teardown."""
    leaving.proc.wait(60)
    until(lambda: exited, 5, "the exit seen")
    print(f"the draining node exited {exited[0] - signalled:.1f}s after the signal")
    assert exited[0] - signalled <= GRACE_S + TEARDOWN_S, leaving.log_tail(40)
    assert leaving.proc.returncode == 0, leaving.log_tail(40)


def post_rooms(stack, leaving, prompts, tokens, signal_at):
    """Post the rooms one after another, SIGTERM to ``leaving`` before room ``signal_at``; each
    room's prompt, whether it was posted after the signal, and its end; and when the signal went."""
    posted = []
    with httpx.Client(base_url=stack.bootstrap.url, timeout=WAIT_S + 10) as client:
        for i, prompt in enumerate(prompts):
            if i == signal_at:
                leaving.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
            created = client.post("/rooms", json={"prompt": prompt, "max_new_tokens": tokens[i]})
            assert created.status_code == 201, created.text
            posted.append(created.json()["room"])
        finals = [client.get(f"/rooms/{room}", params={"wait": WAIT_S}).json() for room in posted]
    return [(p, i >= signal_at, f) for i, (p, f) in enumerate(zip(prompts, finals, strict=True))], signalled


def test_rooms_posted_while_a_decode_node_drains_all_succeed(fast_stack, model):
    stack = fast_stack
    prefill, staying, leaving, exited = start_nodes(stack)
    prompts = [f"drain under load {i} " * (1 + i % 3) for i in range(32)]
    tokens = [60] * 8 + [16] * 24  # what the node takes ends within its grace period
    rooms, signalled = post_rooms(stack, leaving, prompts, tokens, 8)
    check_exit(leaving, exited, signalled)
    refused = 0
    for (prompt, _, final), count in zip(rooms, tokens, strict=True):
        assert (final["state"], final["reason"]) == ("SUCCESS", None), final
        assert final["output_ids"] == generate(model, encode_text(prompt), count)
        if any(a["reason"] == "draining" for a in final["attempts"]):
            assert final["decode"]["node_id"] == "decode-a", final
            refused += 1
    print(f"{refused} rooms refused by the draining node and placed again")
    assert refused  # rooms kept coming while the bootstrap had not yet heard the node drains
    nodes = {n["node_id"] for n in httpx.get(f"{stack.bootstrap.url}/nodes").json()}
    assert nodes == {"prefill-0", "decode-a"}
    until(lambda: pools_full(prefill, staying), 10, "pools full")


def test_a_drain_ends_what_still_runs_at_its_grace_shutdown_and_exits(fast_stack, model):
    """Rooms that decode past the grace period end FAILED ``shutdown`` (never as a lost node), and the
    node exits within its grace and a little teardown, however long their decodes would take."""
    stack = fast_stack
    prefill, staying, leaving, exited = start_nodes(stack)
    prompts = [f"a long room {i}" for i in range(8)]
    rooms, signalled = post_rooms(stack, leaving, [*prompts, "the signal"], [1000] * 8 + [16], 8)
    check_exit(leaving, exited, signalled)
    ends = [(f["decode"]["node_id"], f["state"], f["reason"]) for _, _, f in rooms]
    assert ("decode-b", "FAILED", "shutdown") in ends, ends
    for (prompt, _, final), node in zip(rooms, ends, strict=True):
        if final["state"] == "SUCCESS":
            assert final["output_ids"] == generate(model, encode_text(prompt), len(final["output_ids"]))
        else:
            assert node[1:] == ("FAILED", "shutdown") and node[0] == "decode-b", final
    until(lambda: pools_full(prefill, staying), 10, "pools full")


def test_a_model_decoding_in_its_thread_does_not_hold_the_exit(fast_stack, tmp_path):
    """A Hugging Face model decodes in a thread of its own: the drained node exits without it."""
    from launcher.tiny_model import write_tiny_model

    stack = fast_stack
    path = str(write_tiny_model("llama", tmp_path / "tiny-llama"))
    stack.bootstrap.args += ["--model", path, "--max-new-tokens", "4000"]
    grace = 0.1  # the room decodes past it
    node_args = ["--model", path, *FAST_NODE, "--drain-grace-s", str(grace)]
    stack.start(node_args, node_args)
    decode = next(s for s in stack.services if s.name == "decode-0")
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "go on and on", "max_new_tokens": 4000}).json()["room"]
        until(lambda: client.get(f"/rooms/{room}").json()["state"] == "SUCCESS", 30, "decoding")
        decode.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        decode.proc.wait(60)
        exited = time.monotonic() - signalled
        final = client.get(f"/rooms/{room}", params={"wait": 10}).json()
    print(f"the draining node exited {exited:.1f}s after the signal")
    assert (final["state"], final["reason"]) == ("FAILED", "shutdown"), final
    assert exited <= grace + TEARDOWN_S, decode.log_tail(40)
