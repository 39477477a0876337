"""The reference model: float64 GQA, deterministic, paged, and the same tokens at any tensor-parallel size."""

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shared.kv.head_split import HeadRange
from shared.kv.pool import KVPool
from shared.models.reference import (
    ModelConfig,
    ReferenceModel,
    configure_determinism,
    decode_text,
    encode_text,
    generate,
)

PROMPTS = ["hello", "tensor parallel ranks must agree " * 3, "x", "KV heads are shared by query heads"]


@pytest.fixture(scope="module")
def model():
    configure_determinism()
    return ReferenceModel()


def test_float64_with_grouped_query_attention(model):
    config = model.config
    assert (config.num_heads, config.num_kv_heads) == (8, 4)
    assert model.embed.dtype is torch.float64 and model.layers[0]["k"].dtype is torch.float64
    assert model.kv_layout(16).dtype == "float64" and model.kv_layout(16).num_kv_heads == 4
    assert model.layers[0]["q"].shape[1] == 8 * config.head_dim
    assert model.layers[0]["k"].shape[1] == 4 * config.head_dim  # half as many KV heads
    assert model._kv_of_query.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_weights_come_from_the_seed(model):
    other = ReferenceModel()
    assert all(
        torch.equal(a, b) for a, b in zip(model.layers[0].values(), other.layers[0].values(), strict=True)
    )
    reseeded = ReferenceModel(ModelConfig(seed=99))
    assert not torch.equal(model.layers[0]["q"], reseeded.layers[0]["q"])


def test_generate_is_deterministic_and_prompt_dependent(model):
    a = generate(model, encode_text("hello"), 12)
    assert a == generate(model, encode_text("hello"), 12)
    assert a == generate(ReferenceModel(), encode_text("hello"), 12)  # another instance, same tokens
    assert len(a) == 12 and all(32 <= t < 127 for t in a)
    assert a != generate(model, encode_text("goodbye"), 12)


@pytest.mark.parametrize("page_size", [1, 4, 64])
def test_page_size_does_not_change_tokens(model, page_size):
    ids = encode_text("paged attention reads what prefill wrote " * 3)
    assert generate(model, ids, 10, page_size) == generate(model, ids, 10, 16)


def prefilled(model, ids, max_new_tokens):
    """A pool holding the prompt's KV: (layout, pool, its pages, the first output token)."""
    layout = model.kv_layout(16)
    n = layout.room_pages("decode", len(ids), max_new_tokens)
    pool = KVPool(layout, n)
    pages = pool.alloc(n)
    first, _ = model.prefill(pool, pages, ids)
    return layout, pool, pages, first


def test_kv_moved_to_scattered_pages_decodes_the_same(model):
    """What a disaggregated run does: prefill in one pool, copy pages, decode in another."""
    ids = encode_text("x" * 70)
    layout, src, src_pages, first = prefilled(model, ids, 8)
    n = len(src_pages)
    dst = KVPool(layout, 32)
    dst_pages = [30, 2, 17, 5, 9, 11][:n]
    for s, d in zip(src_pages[: layout.pages_for(len(ids))], dst_pages, strict=False):
        dst.data[d] = src.data[s]
    assert model.decode(dst, dst_pages, len(ids), first, 8) == generate(model, ids, 8)


@pytest.mark.parametrize("damage", ["no page landed", "garbage in the first page"])
def test_corrupted_kv_changes_the_output(model, damage):
    """Decode reads the prompt's KV from the pages: without it, or with garbage, other tokens come."""
    ids = encode_text("the transferred KV matters " * 4)
    layout, pool, pages, first = prefilled(model, ids, 12)
    if damage == "no page landed":
        pool.data[pages[: layout.pages_for(len(ids))]] = 0
    else:
        g = torch.Generator().manual_seed(3)
        page = pool.data[pages[0]]
        page.copy_(torch.randn(page.shape, generator=g, dtype=page.dtype) * 3)
    assert model.decode(pool, pages, len(ids), first, 12) != generate(model, ids, 12)


def test_too_few_pages_are_refused(model):
    ids = encode_text("y" * 40)
    pool = KVPool(model.kv_layout(16), 4)
    with pytest.raises(ValueError):
        model.prefill(pool, pool.alloc(2), ids)  # 40 tokens need 3 pages of 16


def test_prefill_without_pages_stores_nothing_and_gives_the_same_first_token(model):
    ids = encode_text("a rank that holds no pages still computes")
    _, _, _, first = prefilled(model, ids, 4)
    empty = KVPool(model.kv_layout(16), 4)
    token, logprob = model.prefill(empty, None, ids)
    assert token == first and logprob <= 0
    assert not bool(empty.data.any())


def test_decode_stops_early_when_told(model):
    ids = encode_text("stop me")
    full = generate(model, ids, 10)
    _, pool, pages, first = prefilled(model, ids, 10)
    seen: list[list[int]] = []

    def should_stop(out: list[int]) -> bool:
        seen.append(list(out))
        return len(out) >= 4

    assert model.decode(pool, pages, len(ids), first, 10, should_stop=should_stop) == full[:4]
    assert seen == [full[:1], full[:2], full[:3], full[:4]]  # asked before every step, with the output so far


def test_on_token_hears_every_token_including_the_first(model):
    ids = encode_text("listen")
    _, pool, pages, first = prefilled(model, ids, 7)
    heard: list[int] = []
    out = model.decode(pool, pages, len(ids), first, 7, on_token=heard.append)
    assert heard == out and len(out) == 7 and out[0] == first


def test_one_new_token_is_the_first_alone(model):
    ids = encode_text("one")
    _, pool, pages, first = prefilled(model, ids, 1)
    assert model.decode(pool, pages, len(ids), first, 1) == [first]


@pytest.mark.parametrize("tp", [3, 16])
def test_sizes_that_do_not_split_are_refused(tp):
    with pytest.raises(ValueError):
        ReferenceModel(rank=0, tp=tp)


class InMemoryGroup:
    """An all-reduce over threads: each rank puts its tensor in, all sum them in rank order."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.inputs: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def all_reduce_for(self, rank: int) -> Callable[[torch.Tensor], None]:
        def all_reduce(tensor: torch.Tensor) -> None:
            self.calls[rank] += 1
            self.inputs[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.zeros_like(tensor)
            for part in self.inputs:
                assert part is not None
                total += part
            self.barrier.wait()  # every rank has read every input before any is replaced
            tensor.copy_(total)

        return all_reduce


def run_ranks(tp: int, work: Callable[[ReferenceModel], object]) -> list[object]:
    """``work`` on each of ``tp`` ranks of one model, in threads joined by an InMemoryGroup."""
    group = InMemoryGroup(tp)

    def rank_main(rank: int) -> object:
        try:
            return work(ReferenceModel(rank=rank, tp=tp, all_reduce=group.all_reduce_for(rank)))
        except BaseException:
            group.barrier.abort()  # the other ranks stop waiting for this one
            raise

    with ThreadPoolExecutor(tp) as pool:
        futures = [pool.submit(rank_main, r) for r in range(tp)]
        results = [f.result(timeout=120) for f in futures]
    assert len(set(group.calls)) == 1 and group.calls[0] > 0  # every rank took part in every sum
    return results


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_ranks_generate_the_tokens_of_one(model, tp):
    for prompt in PROMPTS:
        ids = encode_text(prompt)
        want = generate(model, ids, 8)

        def work(m: ReferenceModel, ids: list[int] = ids) -> list[int]:
            return generate(m, ids, 8)

        assert run_ranks(tp, work) == [want] * tp, prompt


@pytest.mark.parametrize(("tp", "held"), [(2, [(0, 2), (2, 2)]), (8, [(h // 2, 1) for h in range(8)])])
def test_ranks_hold_their_share_of_heads(tp, held):
    """Eight ranks of four KV heads: each head is held by two ranks (replicated)."""
    ranks = [ReferenceModel(rank=r, tp=tp) for r in range(tp)]
    assert [m.kv_heads for m in ranks] == [HeadRange(s, c) for s, c in held]
    assert [m.q_heads for m in ranks] == [HeadRange(r * 8 // tp, 8 // tp) for r in range(tp)]
    assert all(m.kv_layout(16).num_kv_heads == held[0][1] for m in ranks)


def test_ranks_without_pages_still_agree_on_the_first_token(model):
    """A prefill rank whose heads no decode rank needs computes with the others, storing nothing."""
    ids = encode_text("only rank 0 stores its heads")
    want = model.prefill(KVPool(model.kv_layout(16), 4), None, ids)[0]

    def work(m: ReferenceModel) -> int:
        pool = KVPool(m.kv_layout(16), 4)
        pages = pool.alloc(pool.layout.pages_for(len(ids))) if m.kv_heads.start == 0 else None
        return m.prefill(pool, pages, ids)[0]

    assert run_ranks(2, work) == [want, want]


def test_cli_prints_json(model):
    out = subprocess.run(
        [sys.executable, "-m", "shared.models.reference", "--prompt", "hi", "--max-new-tokens", "5"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    body = json.loads(out.stdout)
    assert body["output_ids"] == generate(model, encode_text("hi"), 5)
    assert body["text"] == decode_text(body["output_ids"])
