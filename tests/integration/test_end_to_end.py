"""Real processes on 127.0.0.1, the real Mooncake engine over TCP."""

import httpx

from shared.models.reference import encode_text, generate
from tests.integration.helpers import metric, pools_full
from tests.support import until

PROMPTS = [
    "a",  # one token
    "Hello, kvroom!",
    "0123456789abcdef",  # exactly one page
    "0123456789abcdefg",  # one token into the second page
    "The quick brown fox jumps over the lazy dog.",
    "long prompt spanning many pages " * 40,  # 1280 tokens, 80 pages
    *[f"room number {i}: " + "xyz" * i for i in range(10)],
]


def test_sixteen_rooms_match_the_colocated_run_and_free_everything(stack, model):
    prefill, decode = stack.start()
    assert len(PROMPTS) == 16
    with stack.client() as client:
        created = []
        for i, prompt in enumerate(PROMPTS):
            resp = client.post("/rooms", json={"prompt": prompt, "max_new_tokens": 4 + i})
            assert resp.status_code == 201, resp.text
            body = resp.json()
            assert 0 < body["room"] < 2**63
            assert body["prefill"]["node_id"] == "prefill-0" and body["decode"]["node_id"] == "decode-0"
            assert body["prefill"]["session_ids"] and body["decode"]["session_ids"]
            created.append(body)
        assert len({b["room"] for b in created}) == 16
        for i, (prompt, body) in enumerate(zip(PROMPTS, created, strict=True)):
            final = client.get(f"/rooms/{body['room']}", params={"wait": 60}).json()
            assert final["state"] == "SUCCESS", final
            assert final["reason"] is None
            assert final["output_ids"] == generate(model, encode_text(prompt), 4 + i)
            assert final["text"] == bytes(final["output_ids"]).decode()
            stamps = final["timestamps"]
            assert stamps["BOOTSTRAPPING"] <= stamps["WAITING_FOR_INPUT"] <= stamps["TRANSFERRING"]
            assert stamps["TRANSFERRING"] <= stamps["SUCCESS"]
            # The prefill's own report may trail the decode's by a moment.
            until(
                lambda room=body["room"]: (
                    client.get(f"/rooms/{room}").json()["node_states"]["prefill"]["state"] == "SUCCESS"
                ),
                10,
                "the prefill's report",
            )
        listed = client.get("/rooms", params={"state": "SUCCESS"}).json()
        assert {r["room"] for r in listed} == {b["room"] for b in created}
    until(lambda: pools_full(prefill, decode), 10, "pages and aux slots back in their pools")
    assert metric(decode, "kvroom_free_pages") == metric(decode, "kvroom_total_pages")
    assert metric(decode, "kvroom_free_aux_slots") == metric(decode, "kvroom_total_aux_slots")
    assert metric(decode, "kvroom_room_transitions_total", 'state="SUCCESS"') == 16
    assert metric(prefill, "kvroom_transfer_bytes_total") > 80 * 16 * 1024
    assert metric(stack.bootstrap, "kvroom_live_decode_nodes") == 1
    nodes = httpx.get(f"{stack.bootstrap.url}/nodes").json()
    assert {n["role"] for n in nodes} == {"prefill", "decode"} and all(n["alive"] for n in nodes)
