"""SUCCESS waits for the aux: a proxy in front of the decode node holds done+aux messages."""

import contextlib

import pytest

from shared.kv.aux_buffers import AUX_RECORD, Aux
from shared.models.reference import encode_text, generate
from shared.wire import protocol
from tests.integration.helpers import metric, node_transfer, pools_full
from tests.integration.holding_proxy import in_front_of
from tests.support import until
from tests.support.stacks import NOTICES_AT_ONCE


@pytest.fixture
def held(stack):
    """Start prefill and decode nodes with a proxy in front of the decode holding ``kinds``; the
    prefill sends its notices at once unless ``prefill_args`` say otherwise."""

    def start(
        *decode_args: str,
        kinds: tuple[type, ...] = (protocol.DoneAux,),
        prefill_args: list[str] = NOTICES_AT_ONCE,
    ):
        stack.bootstrap.start()
        stack.bootstrap.wait_healthy(registered=False)
        decode = stack.node("decode", "decode-0", list(decode_args))
        proxy = exits.enter_context(in_front_of(decode, lambda m: isinstance(m, kinds)))
        decode.start()
        prefill = stack.node("prefill", "prefill-0", list(prefill_args)).start()
        decode.wait_healthy()
        prefill.wait_healthy()
        return prefill, decode, proxy

    with contextlib.ExitStack() as exits:
        yield start


def rejected(service, kind: str) -> float:
    return metric(service, "kvroom_messages_rejected_total", f'kind="{kind}"')


def test_room_is_not_success_until_its_aux_arrives(stack, held, model):
    prefill, decode, proxy = held()
    with stack.client() as client:
        # A room beside the held one must go on unaffected.
        other = client.post("/rooms", json={"prompt": "a neighbour", "max_new_tokens": 6}).json()["room"]
        prompt = "held back " * 10
        room = client.post("/rooms", json={"prompt": prompt, "max_new_tokens": 8}).json()["room"]
        until(lambda: proxy.held_rooms() == {room, other}, 20, "both done+aux messages held")
        proxy.release(other)

        # KV writes completed (the prefill is done), the aux is missing: not SUCCESS.
        until(lambda: node_transfer(prefill, room)["state"] == "SUCCESS", 10, "the prefill to finish")
        until(lambda: client.get(f"/rooms/{room}").json()["state"] == "TRANSFERRING", 10, "the report")
        for _ in range(10):
            assert node_transfer(decode, room)["state"] == "TRANSFERRING"
            assert client.get(f"/rooms/{room}").json()["state"] == "TRANSFERRING"
        assert client.get(f"/rooms/{other}", params={"wait": 30}).json()["state"] == "SUCCESS"

        # The done notice alone, its aux frame cut off: the KV is done, the aux is not here.
        proxy.inject(proxy.held_for(room)[:2])
        until(lambda: rejected(decode, "aux_missing") == 1, 10, "the done notice without aux")
        for _ in range(10):
            assert node_transfer(decode, room)["state"] == "TRANSFERRING"

        proxy.release()
        final = client.get(f"/rooms/{room}", params={"wait": 30}).json()
        assert final["state"] == "SUCCESS", final
        assert final["output_ids"] == generate(model, encode_text(prompt), 8)
        until(lambda: pools_full(prefill, decode), 10, "pools back to full")


def test_aux_held_past_the_aux_timeout_fails_the_room(stack, held):
    prefill, decode, proxy = held("--aux-timeout-s", "1")
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "late aux", "max_new_tokens": 4}).json()["room"]
        until(lambda: proxy.held_rooms() == {room}, 20, "the done+aux message held")
        proxy.inject(proxy.held_for(room)[:2])  # the done notice arrives, its aux does not
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert (final["state"], final["reason"]) == ("FAILED", "aux_timeout")
        assert node_transfer(decode, room)["reason"] == "aux_timeout"
        # The aux that comes too late is refused: the room stays FAILED.
        proxy.release()
        until(lambda: rejected(decode, "finished") == 1, 10, "the late aux refused")
        assert client.get(f"/rooms/{room}").json()["state"] == "FAILED"
        until(lambda: pools_full(prefill, decode), 10, "pools back to full")


def test_duplicated_aux_gives_one_success(stack, held, model):
    prefill, decode, proxy = held()
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "twice", "max_new_tokens": 5}).json()["room"]
        until(lambda: proxy.held_rooms() == {room}, 20, "the done+aux message held")
        frames = proxy.held_for(room)
        proxy.inject(frames)
        proxy.inject(frames)
        proxy.drop(room)
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert final["state"] == "SUCCESS"
        assert final["output_ids"] == generate(model, encode_text("twice"), 5)
        # Refused as a duplicate while the room decodes, or as late once it finished.
        until(lambda: rejected(decode, "duplicate") + rejected(decode, "finished") == 1, 10, "the duplicate")
        assert metric(decode, "kvroom_room_transitions_total", 'state="SUCCESS"') == 1
        until(lambda: pools_full(prefill, decode), 10, "pools back to full")


def test_aux_naming_another_room_fails_only_that_room(stack, held, model):
    prefill, decode, proxy = held()
    with stack.client() as client:
        a = client.post("/rooms", json={"prompt": "room a", "max_new_tokens": 5}).json()["room"]
        b = client.post("/rooms", json={"prompt": "room b", "max_new_tokens": 5}).json()["room"]
        until(lambda: proxy.held_rooms() == {a, b}, 20, "both done+aux messages held")
        frames = proxy.held_for(a)
        header, body, record = frames
        _, first, cached, logprob, _ = AUX_RECORD.unpack(record)
        # An intact record (its own digest matches) that names another room.
        proxy.inject([header, body, Aux(b, first, cached, logprob).pack()], like=frames)
        proxy.drop(a)
        final_a = client.get(f"/rooms/{a}", params={"wait": 20}).json()
        assert (final_a["state"], final_a["reason"]) == ("FAILED", "aux_invalid")
        assert final_a["output_ids"] is None
        proxy.release(b)
        final_b = client.get(f"/rooms/{b}", params={"wait": 20}).json()
        assert final_b["state"] == "SUCCESS"
        assert final_b["output_ids"] == generate(model, encode_text("room b"), 5)
        until(lambda: pools_full(prefill, decode), 10, "pools back to full")


@pytest.mark.parametrize(
    ("kinds", "prefill_args", "reason"),
    [
        (
            (protocol.TransferAccepted, protocol.TransferStarted, protocol.DoneAux),
            NOTICES_AT_ONCE,
            "bootstrap_timeout",
        ),
        ((protocol.TransferStarted, protocol.DoneAux), NOTICES_AT_ONCE, "waiting_timeout"),
        ((protocol.DoneAux,), NOTICES_AT_ONCE, "transfer_timeout"),
        # A room written before its notices were due sends none: its lost done+aux was all
        # the decode would have heard.
        ((protocol.DoneAux,), ["--progress-notice-s", "30"], "bootstrap_timeout"),
    ],
)
def test_each_waiting_state_times_out_with_its_reason(stack, held, kinds, prefill_args, reason):
    stack.bootstrap.args += ["--max-attempts", "1"]  # the room ends with its first attempt
    flags = ["--bootstrap-timeout-s", "1", "--waiting-timeout-s", "1", "--transfer-timeout-s", "1"]
    prefill, decode, proxy = held(*flags, kinds=kinds, prefill_args=prefill_args)
    with stack.client() as client:
        room = client.post("/rooms", json={"prompt": "stuck", "max_new_tokens": 4}).json()["room"]
        final = client.get(f"/rooms/{room}", params={"wait": 20}).json()
        assert (final["state"], final["reason"]) == ("FAILED", reason)
        assert node_transfer(decode, room)["reason"] == reason
        assert metric(decode, "kvroom_room_failures_total", f'reason="{reason}"') == 1
        assert metric(stack.bootstrap, "kvroom_room_failures_total", f'reason="{reason}"') == 1
        proxy.release()  # whatever comes late changes nothing
        until(lambda: pools_full(prefill, decode), 10, "pools back to full")
        assert client.get(f"/rooms/{room}").json()["state"] == "FAILED"
