"""500 rooms, 32 in flight, 10% of them aborted: half at once, half at random moments."""

import asyncio
import random

import httpx

from shared.models.reference import encode_text, generate
from tests.integration.helpers import pools_full
from tests.support import until

ROOMS = 500
IN_FLIGHT = 32
MAX_NEW_TOKENS = 6


async def run_soak(base_url: str, prompts: list[str], abort: set[int], seed: int):
    rng = random.Random(seed)
    gate = asyncio.Semaphore(IN_FLIGHT)
    async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:

        async def one(i: int):
            async with gate:
                resp = await client.post(
                    "/rooms", json={"prompt": prompts[i], "max_new_tokens": MAX_NEW_TOKENS}
                )
                assert resp.status_code == 201, resp.text
                room = resp.json()["room"]
                aborted = False
                if i in abort:
                    # Half at once, into a long prefill: these land in flight however fast
                    # rooms are. Half at random moments, some of which find the room done.
                    await asyncio.sleep(0 if i % 2 else rng.uniform(0, 0.05))
                    status = (await client.delete(f"/rooms/{room}")).status_code
                    assert status in (200, 409)
                    aborted = status == 200
                for _ in range(10):
                    body = (await client.get(f"/rooms/{room}", params={"wait": 30})).json()
                    if body["finished"]:
                        return i, body, aborted
                raise AssertionError(f"room {room} never finished: {body}")

        return await asyncio.gather(*(one(i) for i in range(ROOMS)))


def test_soak_with_random_aborts(stack, model):
    prefill, decode = stack.start()
    distinct = [f"soak prompt {k}: " + "abc" * k for k in range(40)]
    rng = random.Random(2026)
    abort = set(rng.sample(range(ROOMS), ROOMS // 10))
    long_prompt = "soak, aborted at once: " + "xyz" * 400
    prompts = [long_prompt if i in abort and i % 2 else distinct[i % len(distinct)] for i in range(ROOMS)]
    distinct.append(long_prompt)
    results = asyncio.run(run_soak(stack.bootstrap.url, prompts, abort, seed=1))
    expected = {p: generate(model, encode_text(p), MAX_NEW_TOKENS) for p in distinct}
    aborted = 0
    for i, body, was_aborted in results:
        if was_aborted:
            aborted += 1
            assert (body["state"], body["reason"]) == ("FAILED", "aborted"), body
        else:
            assert body["state"] == "SUCCESS", body
            assert body["output_ids"] == expected[prompts[i]]
    assert aborted > 0
    until(lambda: pools_full(prefill, decode), 30, "every page and aux slot back")
    with stack.client() as client:
        assert client.get("/health").json()["rooms_in_flight"] == 0
