"""kvroom inside vLLM: real vLLM servers (CPU) with KvroomConnector behind a kvroom bootstrap (CURVE,
join token), against one plain vLLM serving the same tiny Llama.

Each server holds its core busy while it lives: the plain one runs alone, before the pair.
"""

import concurrent.futures
import json
import random
import time

import httpx
import msgspec
import pytest

from shared.wire import grants, protocol
from tests.support import until
from tests.support.vllm_servers import VLLM_PYTHON, VllmCluster, VllmServer, tiny_llama

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="bash setup.sh vllm makes .venv-vllm")

HOOKED = {"kv_connector": "HookedKvroomConnector", "kv_connector_module_path": "tests.support.vllm_hooks"}
MAX_TOKENS = 12
CHAT = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}


def prompts() -> list[list[int] | str]:
    """20 prompts: a 1-token one, one of about 400, token ids of lengths between, and texts."""
    rng = random.Random(7)
    ids: list[list[int] | str] = [[rng.randrange(3, 500)]]
    ids += [[rng.randrange(3, 500) for _ in range(n)] for n in (400, 2, 17, 64, 127, 128, 129, 255, 300)]
    ids += [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 200))] for _ in range(6)]
    ids += ["hello world", "the cat sits on the mat and looks at the", "a" * 50, "1 2 3 4 5 6 7 8"]
    return ids


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):
    """What one plain vLLM answers, token for token, for each prompt; then it is stopped."""
    server = VllmServer("vllm-plain", model, tmp_path_factory.mktemp("plain"), core=0).start()
    try:
        server.wait_ready()
        out = {}
        with httpx.Client(base_url=server.url, timeout=120) as client:
            for prompt in prompts():
                body = {"model": model.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
                choice = client.post("/v1/completions", json={**body, "return_token_ids": True}).json()
                out[str(prompt)] = choice["choices"][0]["token_ids"]
            chat = {**CHAT, "model": model.name, "temperature": 0, "return_token_ids": True}
            out["chat"] = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["token_ids"]
        return out
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(model, plain, tmp_path_factory):
    c = VllmCluster(tmp_path_factory.mktemp("vllm-pd"), model)
    try:
        c.start(verify_kv=True)  # every block that lands is checked against its prefill's digest
        yield c
    finally:
        c.stop()
        for server in c.servers:
            print(f"----- {server.name} -----\n{server.log_tail(30)}")


def complete(client: httpx.Client, model_name: str, prompt, **extra) -> dict:
    body = {"model": model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def output_ids(client: httpx.Client, answer: dict) -> list[int]:
    """The tokens of the room that answered (token ids, where texts differ in how a partial
    character at the end is shown)."""
    room = answer["id"].split("-", 1)[1]
    view = client.get(f"/rooms/{room}").json()
    assert view["state"] == "SUCCESS" and view["outcome"] == "completed", view
    return view["output_ids"]


def test_every_output_equals_one_plain_vllm_token_for_token_one_at_a_time_and_eight_at_once(
    cluster, plain, model
):
    prefill, decode = cluster.servers
    loaded_before = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    prompt_tokens = 0
    with cluster.client() as client:
        for prompt in prompts():
            answer = complete(client, model.name, prompt)
            assert output_ids(client, answer) == plain[str(prompt)], prompt
            prompt_tokens += answer["usage"]["prompt_tokens"]
        # The decode computed none of these prompts itself: their KV came through kvroom.
        loaded = decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        assert loaded - loaded_before >= prompt_tokens - len(prompts())  # a 1-token prompt is recomputed
        # The prefill's /metrics counts what its connector wrote (vLLM publishes it a step or two
        # later): a send is a write or more a layer, and every token loaded was written.
        until(lambda: prefill.metric("vllm:kvroom_sends_total") >= len(prompts()) - 1, what="sends counted")
        shape = json.loads((model / "config.json").read_text())
        layers = shape["num_hidden_layers"]
        a_token = layers * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 4  # K and V, float32
        sends = prefill.metric("vllm:kvroom_sends_total")
        assert prefill.metric("vllm:kvroom_writes_total") >= sends * layers
        assert prefill.metric("vllm:kvroom_bytes_written_total") >= (loaded - loaded_before) * a_token
        # Again, 8 at once: the decode now holds some of each prompt, and loads the rest.
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda p: (p, complete(client, model.name, p)), prompts()))
        for prompt, answer in answers:
            assert output_ids(client, answer) == plain[str(prompt)], prompt
    until(
        lambda: (
            decode.metric("vllm:kv_cache_usage_perc") == 0 and prefill.metric("vllm:kv_cache_usage_perc") == 0
        )
    )


def test_a_streamed_completion_equals_the_whole_one_and_a_chat_completion_equals_plain_vllm(
    cluster, plain, model
):
    prompt = "the cat sits on the mat and looks at the"
    with cluster.client() as client:
        whole = complete(client, model.name, prompt)["choices"][0]["text"]
        body = {
            "model": model.name,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        text = ""
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
        assert text == whole
        answer = client.post("/v1/chat/completions", json={**CHAT, "model": model.name})
        assert answer.status_code == 200, answer.text
        assert output_ids(client, answer.json()) == plain["chat"]


def test_transfer_parameters_the_bootstrap_did_not_issue_are_refused_and_nothing_is_computed(cluster, model):
    """A client of a server's OpenAI port that knows the cluster (``/nodes`` is open) names a
    transfer and the other server's real ranks, but cannot sign them."""
    prefill, decode = cluster.servers
    nodes = {n["node_id"]: n for n in cluster.nodes()}
    prompt = list(range(3, 40))

    def forged(role: str, peer: VllmServer, key: bytes = bytes(32), **changed: object) -> dict:
        ranks = [
            protocol.PeerRank(**{k: v for k, v in r.items() if k not in ("alive", "free_pages")})
            for r in nodes[peer.name]["ranks"]
        ]
        node = decode.name if peer is prefill else prefill.name
        grant = grants.TransferGrant(
            12345,
            role,
            node,
            peer.name,
            ranks,
            len(prompt),
            grants.prompt_digest(prompt),
            time.time() + 60,  # type: ignore[arg-type]
        )
        kvroom = {**msgspec.to_builtins(grants.sign(grant, key)), **changed}
        return {
            "model": model.name,
            "prompt": prompt,
            "max_tokens": 4,
            "kv_transfer_params": {"kvroom": kvroom},
        }

    computed = [s.metric("vllm:prompt_tokens_total") for s in (prefill, decode)]
    cases = [
        (prefill, forged("prefill", decode), 403, "not signed by the cluster's bootstrap"),
        (decode, forged("decode", prefill), 403, "not signed by the cluster's bootstrap"),
        (prefill, forged("prefill", decode, signature=""), 403, "not signed by the cluster's bootstrap"),
        (prefill, forged("prefill", decode, peers=[]), 400, "not a transfer grant"),
    ]
    for server, body, status, reason in cases:
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == status, answer.text
        assert reason in answer.json()["error"]["message"]
    # Not run, and not run as a plain request: neither server computed a prompt token.
    assert [s.metric("vllm:prompt_tokens_total") for s in (prefill, decode)] == computed
    with cluster.client() as client:  # rooms the bootstrap placed go on
        answer = complete(client, model.name, prompt)
        assert len(output_ids(client, answer)) == MAX_TOKENS


def test_a_bootstrap_killed_with_rooms_in_flight_and_restarted_takes_both_servers_back(cluster, plain, model):
    """The bootstrap (its memory store: it forgets every node, and its key is new) is SIGKILLed
    while four requests decode: their clients get an error, both servers give their blocks back,
    register again with the new bootstrap, and serve its rooms with its new signing key."""
    prefill, decode = cluster.servers
    # The longest prompt and 300 tokens out: in flight for seconds.
    body = {"model": model.name, "prompt": prompts()[1], "max_tokens": 300, "temperature": 0}

    def request(_) -> int | Exception:
        try:
            with cluster.client() as client:
                return client.post("/v1/completions", json=body).status_code
        except httpx.HTTPError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = [pool.submit(request, i) for i in range(4)]
        until(lambda: decode.metric("vllm:num_requests_running") > 0, what="a request decoding")
        cluster.bootstrap.kill()
        ended = [a.result(timeout=60) for a in answers]
    assert any(isinstance(e, httpx.HTTPError) for e in ended), ended  # at least one was cut off
    usage = "vllm:kv_cache_usage_perc"
    until(lambda: prefill.metric(usage) == decode.metric(usage) == 0, what="both servers' blocks free")
    cluster.bootstrap.start()  # same ports, nothing remembered
    cluster.bootstrap.wait_healthy(registered=False)
    for server in (prefill, decode):
        cluster.wait_registered(server.name)
    with cluster.client() as client:
        for text in prompts()[-4:]:
            assert output_ids(client, complete(client, model.name, text)) == plain[str(text)], text


def test_a_server_that_stops_leaves_the_cluster_before_it_exits(cluster):
    prefill = cluster.servers[0]
    prefill.stop()  # SIGTERM, and wait for the process to exit
    assert all(n["node_id"] != prefill.name for n in cluster.nodes())
