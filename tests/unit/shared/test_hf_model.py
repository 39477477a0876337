"""HFSource: a tiny Llama and Qwen2, prefilled into pages, moved and decoded to generate()'s tokens."""

import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig, GPT2Config

from launcher.local_stack import free_port
from launcher.tiny_model import ARCHS, EOS_ID, write_tiny_model
from prefill_node.settings import PrefillSettings
from shared.kv.head_split import writers
from shared.kv.pool import KVPool
from shared.models.files import greedy_differences, model_dir, tokenizer_digest, weights_digest
from shared.models.hf import HFSource
from shared.models.source import DecodeRequest, KVSource, make_source

REPO = Path(__file__).resolve().parents[3]
TEXTS = [
    "The cat",  # cut to its first token below
    "Hello, world! How are you today?",
    "A prefill node reads the prompt and writes the key and value cache, then the decode node "
    "receives the pages and generates one token at a time.",
]
EOS_PROMPT = "A teacher remembers a long letter in the garden?"  # qwen2 seed 1: EOS is new token 41
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {arch: write_tiny_model(arch, tmp_path_factory.mktemp(arch), seed=0) for arch in ARCHS}
    out["qwen2-seed1"] = write_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2-seed1"), seed=1)
    out["qwen2-again"] = write_tiny_model("qwen2", tmp_path_factory.mktemp("qwen2-again"), seed=0)
    return out


def settings(path: Path, dtype: str = "float64", tp: int = 1, page_size: int = 4) -> PrefillSettings:
    return PrefillSettings(
        http_port=free_port(),
        zmq_port=free_port(),
        model=str(path),
        dtype=dtype,
        tp_size=tp,
        page_size=page_size,
        zmq_security="plain",
    )


@pytest.fixture(scope="module")
def single() -> Callable[[Path, str], Any]:
    """One-rank sources, loaded once per checkpoint and dtype."""
    loaded: dict[tuple[Path, str], Any] = {}

    def get(path: Path, dtype: str) -> Any:
        if (path, dtype) not in loaded:
            loaded[path, dtype] = HFSource(settings(path, dtype), 0, None)
        return loaded[path, dtype]

    return get


def prompts(source: Any) -> list[list[int]]:
    ids = [source.tokenizer(text)["input_ids"] for text in TEXTS]
    ids[0] = ids[0][:1]
    assert all(0 not in p for p in ids)  # no pad token: generate() attends to every prompt token
    return ids


def generated(source: Any, ids: list[int], n: int) -> list[int]:
    out = source.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(ids) :]]


def byte_pages(pool: KVPool) -> torch.Tensor:
    return pool.data.view(torch.uint8).reshape(pool.num_pages, -1)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_from_moved_pages_is_generate(checkpoints, single, arch, dtype):
    source = single(checkpoints[arch], dtype)
    layout = source.kv_layout(4)
    for ids in prompts(source):
        want = generated(source, ids, NEW_TOKENS)
        a, b = KVPool(layout, 64), KVPool(layout, 64)
        a_pages = a.alloc(layout.pages_for(len(ids)))
        first, logprob = source.prefill(7, a, a_pages, ids)
        b_pages = [63 - 2 * i for i in range(len(a_pages))]  # other indices, not in order
        for s, d in zip(a_pages, b_pages, strict=True):
            byte_pages(b)[d] = byte_pages(a)[s]
        heard: list[int] = []
        decoded = source.decode(b, DecodeRequest(7, b_pages, len(ids), first, NEW_TOKENS, [], heard.append))
        assert first == want[0] and logprob < 0
        assert decoded.output_ids == want == heard
        assert decoded.finish_reason == ("stop" if want[-1] == EOS_ID else "length")
    assert len(ids) > 4 * 4  # the last prompt spans several pages


def test_a_page_size_of_16_gives_the_same_tokens(checkpoints, single):
    source = single(checkpoints["llama"], "float32")
    layout = source.kv_layout(16)
    ids = prompts(source)[2]
    pool = KVPool(layout, 8)
    pages = pool.alloc(layout.pages_for(len(ids)))
    first, _ = source.prefill(1, pool, pages, ids)
    assert source.decode(pool, DecodeRequest(1, pages, len(ids), first, 12, [])).output_ids == generated(
        source, ids, 12
    )


def test_prefill_without_pages_stores_nothing_and_gives_the_same_first_token(checkpoints, single):
    source = single(checkpoints["qwen2"], "float32")
    ids = prompts(source)[1]
    pool = KVPool(source.kv_layout(4), 16)
    with_pages = source.prefill(2, pool, pool.alloc(4), ids)
    empty = KVPool(source.kv_layout(4), 16)
    assert source.prefill(2, empty, None, ids) == with_pages
    assert not bool(empty.data.any()) and bool(pool.data.any())


def test_decode_reads_the_prompt_from_the_pages(checkpoints, single):
    """Without the prompt's KV in the pages, other tokens come: decode does not recompute it."""
    source = single(checkpoints["llama"], "float64")
    ids = prompts(source)[2]
    want = generated(source, ids, 12)
    pool = KVPool(source.kv_layout(4), 16)
    pages = pool.alloc(16)
    first, _ = source.prefill(6, pool, pages, ids)
    pool.data[pages[1]] = 0
    assert source.decode(pool, DecodeRequest(6, pages, len(ids), first, 12, [])).output_ids != want


def test_too_few_pages_and_a_foreign_layout_are_refused(checkpoints, single):
    source = single(checkpoints["qwen2"], "float32")
    ids = prompts(source)[2]
    pool = KVPool(source.kv_layout(4), 16)
    with pytest.raises(ValueError, match="pages"):
        source.prefill(3, pool, pool.alloc(2), ids)
    other = KVPool(source.kv_layout(4).with_heads(1), 16)
    with pytest.raises(ValueError, match="layout"):
        source.prefill(3, other, other.alloc(16), ids)


def test_a_stop_string_ends_the_output_where_its_text_appears(checkpoints, single):
    source = single(checkpoints["qwen2"], "float32")
    ids = prompts(source)[1]
    want = generated(source, ids, NEW_TOKENS)
    text = source.tokenizer.decode
    stop = text(want[:6])[-3:]
    cut = next(k for k in range(1, len(want) + 1) if stop in text(want[:k]))
    assert cut < len(want)
    pool = KVPool(source.kv_layout(4), 16)
    pages = pool.alloc(16)
    first, _ = source.prefill(4, pool, pages, ids)
    decoded = source.decode(pool, DecodeRequest(4, pages, len(ids), first, NEW_TOKENS, ["never seen", stop]))
    assert (decoded.output_ids, decoded.finish_reason) == (want[:cut], "stop")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_end_of_sequence_stops_the_output_as_generate_does(checkpoints, single, dtype):
    source = single(checkpoints["qwen2-seed1"], dtype)
    ids = source.tokenizer(EOS_PROMPT)["input_ids"]
    want = generated(source, ids, 60)
    assert want.index(EOS_ID) == 41 and len(want) == 42  # generate() keeps the EOS token
    pool = KVPool(source.kv_layout(4), 16)
    pages = pool.alloc(16)
    first, _ = source.prefill(5, pool, pages, ids)
    decoded = source.decode(pool, DecodeRequest(5, pages, len(ids), first, 60, []))
    assert (decoded.output_ids, decoded.finish_reason) == (want, "stop")


class InMemoryGroup:
    """An all-reduce over threads: each rank puts its tensor in, all sum them in rank order."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=60)
        self.inputs: list[torch.Tensor | None] = [None] * world

    def all_reduce_for(self, rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(tensor: torch.Tensor) -> None:
            self.inputs[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.zeros_like(tensor)
            for part in self.inputs:
                assert part is not None
                total += part
            self.barrier.wait()  # every rank has read every input before any is replaced
            tensor.copy_(total)

        return all_reduce


@dataclass
class Node:
    """The ranks of one node, each with its own source and pool."""

    sources: list[Any]
    group: InMemoryGroup | None

    @classmethod
    def start(cls, path: Path, tp: int) -> "Node":
        group = InMemoryGroup(tp) if tp > 1 else None
        return cls(
            [HFSource(settings(path, tp=tp), r, group and group.all_reduce_for(r)) for r in range(tp)], group
        )

    def run(self, work: Callable[[int, Any], object]) -> list[object]:
        def rank_main(rank: int) -> object:
            try:
                return work(rank, self.sources[rank])
            except BaseException:
                if self.group is not None:
                    self.group.barrier.abort()  # the other ranks stop waiting for this one
                raise

        with ThreadPoolExecutor(len(self.sources)) as pool:
            futures = [pool.submit(rank_main, r) for r in range(len(self.sources))]
            return [f.result(timeout=120) for f in futures]


@pytest.fixture(scope="module")
def nodes(checkpoints) -> Callable[[int], Node]:
    started: dict[int, Node] = {}

    def get(tp: int) -> Node:
        if tp not in started:
            started[tp] = Node.start(checkpoints["qwen2"], tp)
        return started[tp]

    return get


def move_room(prefill: Node, decode: Node, ids: list[int], new_tokens: int) -> list[list[int]]:
    """Prefill on every rank of ``prefill``, copy each decode rank's heads page by page from the
    prefill rank ``writers`` names, decode on every rank of ``decode``: each decode rank's output."""
    layouts = [s.kv_layout(4) for s in prefill.sources]
    src = [KVPool(layout, 16) for layout in layouts]
    src_pages = [pool.alloc(layout.pages_for(len(ids))) for pool, layout in zip(src, layouts, strict=True)]
    firsts = prefill.run(lambda r, s: s.prefill(9, src[r], src_pages[r], ids))
    assert len(set(firsts)) == 1  # every rank picks the same token
    dst = [KVPool(s.kv_layout(4), 32) for s in decode.sources]
    dst_pages = []
    for pool in dst:
        pool.alloc(3)  # the room's pages start elsewhere than on the prefill side
        dst_pages.append(pool.alloc(len(src_pages[0])))
    held = [s.kv_heads for s in prefill.sources]
    head_bytes = layouts[0].head_bytes
    for d, source in enumerate(decode.sources):
        for p, heads in writers(held, source.kv_heads, d).items():
            at = (heads.start - held[p].start) * head_bytes
            to = (heads.start - source.kv_heads.start) * head_bytes
            length = heads.count * head_bytes
            for s, t in zip(src_pages[p], dst_pages[d], strict=True):
                byte_pages(dst[d])[t, to : to + length] = byte_pages(src[p])[s, at : at + length]
    first = firsts[0][0]  # type: ignore[index]
    decoded = decode.run(
        lambda r, s: s.decode(dst[r], DecodeRequest(9, dst_pages[r], len(ids), first, new_tokens, []))
    )
    return [d.output_ids for d in decoded]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("np_", "nd"), [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1)])
def test_a_room_moves_between_tensor_parallel_sizes(nodes, single, checkpoints, np_, nd):
    reference = single(checkpoints["qwen2"], "float64")
    for ids in prompts(reference)[1:]:
        want = generated(reference, ids, 16)
        assert move_room(nodes(np_), nodes(nd), ids, 16) == [want] * nd


def test_ranks_hold_their_share_of_the_heads(nodes):
    node = nodes(4)
    assert [(s.kv_heads.start, s.kv_heads.count) for s in node.sources] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    attn = node.sources[1].model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (16, 64) and attn.k_proj.bias.shape == (16,)
    assert attn.num_key_value_groups == 1
    assert node.sources[0].kv_layout(4).num_kv_heads == 1


@pytest.mark.parametrize("tp", [3, 8])
def test_sizes_that_do_not_split_are_refused(checkpoints, tp):
    with pytest.raises(ValueError, match="split"):
        HFSource(settings(checkpoints["llama"], tp=tp), 0, lambda t: None)


def test_identity_follows_the_config(checkpoints, single):
    for arch, name in [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]:
        source = single(checkpoints[arch], "float64")
        identity = source.identity
        assert identity.name == checkpoints[arch].name and identity.architecture == name
        assert identity.weights == weights_digest(checkpoints[arch])
        assert identity.tokenizer == tokenizer_digest(checkpoints[arch])
        assert (identity.dtype, identity.num_layers, identity.num_heads) == ("float64", 2, 4)
        assert (identity.num_kv_heads, identity.head_dim, identity.vocab_size) == (2, 16, 512)
        assert identity.page_size == 4 and source.kv_layout(4) == identity.layout(2)
        assert not source.inline
    made = make_source(settings(checkpoints["llama"]), 0, None)  # how a node gets one
    assert isinstance(made, KVSource) and type(made) is HFSource


def test_weights_digest_tells_seeds_apart_and_the_tokenizer_digest_does_not(checkpoints):
    seed0, seed1, again = checkpoints["qwen2"], checkpoints["qwen2-seed1"], checkpoints["qwen2-again"]
    assert weights_digest(seed0) == weights_digest(again) != weights_digest(seed1)
    assert tokenizer_digest(seed0) == tokenizer_digest(seed1)
    assert len(weights_digest(seed0)) == len(tokenizer_digest(seed0)) == 16


def test_the_digests_import_without_torch(checkpoints):
    path = str(checkpoints["llama"])
    code = (
        "import sys; from shared.models.files import tokenizer_digest, weights_digest; "
        f"print(tokenizer_digest({path!r}), weights_digest({path!r})); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        tokenizer_digest(checkpoints["llama"]),
        weights_digest(checkpoints["llama"]),
    ]


def test_other_architectures_are_refused(tmp_path):
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        HFSource(settings(tmp_path), 0, None)


def test_a_hub_id_outside_the_local_cache_is_refused_without_a_download():
    with pytest.raises(ValueError, match="local Hugging Face cache"):
        model_dir("kvroom-tests/no-such-model")
    with pytest.raises(ValueError, match="not a directory"):
        model_dir("/no/such/model/dir")


def test_greedy_differences_name_the_processors_generate_would_add(checkpoints, single):
    assert greedy_differences(single(checkpoints["llama"], "float32").model.generation_config) == []
    config = GenerationConfig(repetition_penalty=1.1, num_beams=1, suppress_tokens=[])
    assert greedy_differences(config) == ["repetition_penalty=1.1"]
