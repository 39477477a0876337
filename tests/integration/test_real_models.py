"""Hugging Face models through the disaggregated path: tiny random Llama and Qwen2 checkpoints,
real processes, the real engine, and the OpenAI client against the bootstrap."""

import asyncio

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from launcher.tiny_model import write_tiny_model
from tests.integration.test_tensor_parallel import all_ranks_full
from tests.support import until

PROMPTS = [
    "a",
    "Hello, kvroom!",
    "The quick brown fox jumps over the lazy dog.",
    "long prompt spanning many pages " * 12,
    *[f"room number {i}: " + "xyz " * i for i in range(12)],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: write_tiny_model(arch, root / f"tiny-{arch}") for arch in ("llama", "qwen2")}


def reference(path, ids_list, new_tokens, dtype=torch.float32):
    """What transformers generates in one process, greedy: the tokens every room must equal."""
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out = []
    with torch.inference_mode():
        for ids in ids_list:
            x = torch.tensor([ids])
            full = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False
            )
            out.append(full[0, len(ids) :].tolist())
    return out


def model_stack(stack, path, prefill_tp=1, decode_tp=1, dtype=None):
    model = ["--model", str(path), *(["--dtype", dtype] if dtype else [])]
    stack.bootstrap.args += ["--model", str(path)]
    return stack.start(
        [*model, "--page-size", "4", "--tp-size", str(prefill_tp)],
        [*model, "--page-size", "4", "--tp-size", str(decode_tp)],
    )


def run(url, ids_list, new_tokens):
    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            made = await asyncio.gather(
                *(
                    client.post("/rooms", json={"input_ids": ids, "max_new_tokens": new_tokens})
                    for ids in ids_list
                )
            )
            return [
                (await client.get(f"/rooms/{r.json()['room']}", params={"wait": 50})).json() for r in made
            ]

    return asyncio.run(go())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sixteen_rooms_equal_generate(stack, checkpoints, arch):
    path = checkpoints[arch]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids_list = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(ids_list[0]) == 1 and len(ids_list[3]) > 4 * 8  # a 1-token prompt, one over many pages
    prefill, decode = model_stack(stack, path)
    finals = run(stack.bootstrap.url, ids_list, 12)
    expected = reference(path, ids_list, 12)
    for final, want in zip(finals, expected, strict=True):
        assert final["state"] == "SUCCESS", final
        assert final["output_ids"] == want
        assert final["text"] == tokenizer.decode(want, skip_special_tokens=True)
    node = httpx.get(f"{stack.bootstrap.url}/nodes").json()[0]
    assert node["model"]["architecture"] in ("LlamaForCausalLM", "Qwen2ForCausalLM")
    assert (node["model"]["num_heads"], node["model"]["num_kv_heads"]) == (4, 2)
    until(lambda: all_ranks_full(prefill) and all_ranks_full(decode), 15, "pools full")


@pytest.mark.parametrize(("np_", "nd"), [(2, 1), (1, 2)])
def test_tensor_parallel_llama_equals_generate(stack, checkpoints, np_, nd):
    path = checkpoints["llama"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids_list = [tokenizer(p)["input_ids"] for p in PROMPTS]
    prefill, decode = model_stack(stack, path, np_, nd, dtype="float64")
    finals = run(stack.bootstrap.url, ids_list, 10)
    expected = reference(path, ids_list, 10, torch.float64)
    for final, want in zip(finals, expected, strict=True):
        assert final["state"] == "SUCCESS", final
        assert final["output_ids"] == want
    heads = [
        (r["kv_head_start"], r["kv_head_count"]) for r in (prefill if np_ > 1 else decode).health()["ranks"]
    ]
    assert heads == [(0, 1), (1, 1)]  # the two KV heads split over the two ranks
    until(lambda: all_ranks_full(prefill) and all_ranks_full(decode), 15, "pools full")


def test_the_openai_client_talks_to_it(stack, checkpoints):
    path = checkpoints["qwen2"]
    model_stack(stack, path)
    client = openai.OpenAI(base_url=f"{stack.bootstrap.url}/v1", api_key="unused", max_retries=0)
    name = path.name
    assert [m.id for m in client.models.list()] == [name]

    done = client.completions.create(model=name, prompt="The cat sat on the", max_tokens=12)
    assert done.choices[0].finish_reason in ("length", "stop") and done.choices[0].text
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens == 12
    streamed = client.completions.create(model=name, prompt="The cat sat on the", max_tokens=12, stream=True)
    chunks = list(streamed)
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason

    stop_word = done.choices[0].text[3:6]
    stopped = client.completions.create(
        model=name, prompt="The cat sat on the", max_tokens=12, stop=[stop_word]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == done.choices[0].text.split(stop_word)[0]

    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi there"}], max_tokens=8
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    parts = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hi there"}], max_tokens=8, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
        == chat.choices[0].message.content
    )

    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=name, prompt="x", max_tokens=0)
    assert bad.value.body["param"] == "max_tokens" and bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"


def test_nodes_with_different_weights_refuse_to_pair(stack, tmp_path):
    first = write_tiny_model("llama", tmp_path / "tiny-llama", seed=0)
    other = write_tiny_model("llama", tmp_path / "other" / "tiny-llama", seed=1)  # same shapes, same name
    stack.bootstrap.args += ["--model", str(first)]
    stack.bootstrap.start()
    stack.bootstrap.wait_healthy(registered=False)
    prefill = stack.node("prefill", "prefill-0", ["--model", str(first)]).start()
    prefill.wait_healthy()
    decode = stack.node("decode", "decode-0", ["--model", str(other)]).start()

    def refused():
        try:
            body = httpx.get(f"{decode.url}/health", timeout=2).json()
        except httpx.HTTPError:
            return None
        return body if body["standing"] == "refused" else None

    body = until(refused, 60, "the decode node to be refused")
    assert "409" in body["problem"] and "weights differs" in body["problem"]
    assert [n["node_id"] for n in httpx.get(f"{stack.bootstrap.url}/nodes").json()] == ["prefill-0"]
