"""Synthetic KV stamps: each head block of a page names its room, its place and its head."""

import pytest
import torch

from shared.kv.layout import KVLayout
from shared.kv.pool import KVPool
from shared.models import synthetic as synthetic_kv

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
WIDE = LAYOUT.with_heads(4)  # a prefill rank holding all four heads of a model split over two decode ranks


@pytest.fixture(params=["words", "tensor ops"])
def path(request, monkeypatch):
    """Both ways of stamping: word by word (CPU pools), and tensor ops (pools on a device)."""
    monkeypatch.setattr(synthetic_kv, "_TENSOR_OPS_ON_CPU", request.param == "tensor ops")


def test_stamps_survive_a_faithful_copy_and_catch_a_wrong_one(path):
    src, dst = KVPool(LAYOUT, 8), KVPool(LAYOUT, 8)
    src_pages, dst_pages = [1, 2, 5], [7, 0, 3]
    synthetic_kv.fill(src, src_pages, room=42)
    for s, d in zip(src_pages, dst_pages, strict=True):
        dst.data[d] = src.data[s]
    assert synthetic_kv.verify(dst, dst_pages, room=42)
    assert not synthetic_kv.verify(dst, dst_pages, room=43)  # another room's stamps
    assert not synthetic_kv.verify(dst, [0, 7, 3], room=42)  # pages out of place
    dst.data[3].view(-1)[-4:] = 0  # the last 8 bytes of the last page never landed
    assert not synthetic_kv.verify(dst, dst_pages, room=42)


def test_unstamped_pages_fail(path):
    assert not synthetic_kv.verify(KVPool(LAYOUT, 4), [0, 1], room=42)


def test_every_head_block_is_stamped_at_both_ends(path):
    pool = KVPool(LAYOUT, 4)
    synthetic_kv.fill(pool, [0, 1], room=9)
    per_head = LAYOUT.head_bytes // 8
    for page in (0, 1):
        blocks = pool.data[page].reshape(LAYOUT.num_kv_heads, -1).view(torch.int64)
        assert blocks.shape[1] == per_head
        for head in range(LAYOUT.num_kv_heads):
            stamp = int(blocks[head, 0])
            assert stamp != 0 and int(blocks[head, -1]) == stamp + 1
            assert not bool(blocks[head, 1:-1].any())  # only the ends are written
    assert not bool(pool.data[2:].any())  # pages not named stay untouched


@pytest.mark.parametrize("where", ["head", "tail"])
def test_a_lost_end_of_any_head_block_fails(path, where):
    pool = KVPool(LAYOUT, 4)
    synthetic_kv.fill(pool, [2, 3], room=11)
    for head in range(LAYOUT.num_kv_heads):
        broken = KVPool(LAYOUT, 4)
        broken.data.copy_(pool.data)
        block = broken.data[3, head].reshape(-1).view(torch.int64)
        block[0 if where == "head" else -1] = 0
        assert not synthetic_kv.verify(broken, [2, 3], room=11), head


def test_a_head_block_in_another_heads_place_fails(path):
    pool = KVPool(LAYOUT, 4)
    synthetic_kv.fill(pool, [0, 1], room=5)
    pool.data[1] = pool.data[1, [1, 0]]  # the two heads of page 1 swapped
    assert not synthetic_kv.verify(pool, [0, 1], room=5)


def test_a_head_block_moved_to_another_page_fails(path):
    pool = KVPool(LAYOUT, 4)
    synthetic_kv.fill(pool, [0, 1], room=5)
    pool.data[1, 0] = pool.data[0, 0]  # head 0 of page 0 landed in page 1
    assert not synthetic_kv.verify(pool, [0, 1], room=5)


def test_heads_split_over_ranks_verify_where_they_land(path):
    """A prefill rank holding four heads writes heads 0-1 to one decode rank and 2-3 to another;
    each decode rank checks its blocks as heads ``first_head`` on, of four."""
    src = KVPool(WIDE, 4)
    synthetic_kv.fill(src, [3, 1], room=77)
    low, high = KVPool(LAYOUT, 4), KVPool(LAYOUT, 4)
    for s, d in zip([3, 1], [0, 2], strict=True):
        low.data[d] = src.data[s, 0:2]
        high.data[d] = src.data[s, 2:4]
    assert synthetic_kv.verify(low, [0, 2], room=77, first_head=0, total_heads=4)
    assert synthetic_kv.verify(high, [0, 2], room=77, first_head=2, total_heads=4)
    # Blocks of other heads, or counted among another number of heads, are not these.
    assert not synthetic_kv.verify(high, [0, 2], room=77, first_head=0, total_heads=4)
    assert not synthetic_kv.verify(low, [0, 2], room=77, first_head=2, total_heads=4)
    assert not synthetic_kv.verify(high, [0, 2], room=77, first_head=2, total_heads=8)
    assert not synthetic_kv.verify(low, [0, 2], room=77)  # two heads of two: another stamp


def test_stamps_differ_for_every_block_of_a_room():
    stamps = {synthetic_kv._stamp(1 << 40, i, h, 4) for i in range(64) for h in range(4)}
    assert len(stamps) == 64 * 4
    heads_and_tails = stamps | {s + 1 for s in stamps}
    assert len(heads_and_tails) == 2 * 64 * 4  # no block's tail is another block's head


@pytest.mark.parametrize(("first_head", "total_heads"), [(0, 0), (0, 2), (2, 4), (6, 8)])
def test_both_paths_stamp_alike(monkeypatch, first_head, total_heads):
    pools = []
    for tensor_ops in (False, True):
        monkeypatch.setattr(synthetic_kv, "_TENSOR_OPS_ON_CPU", tensor_ops)
        pool = KVPool(LAYOUT, 8)
        synthetic_kv.fill(pool, [6, 2, 3], room=(1 << 62) + 5, first_head=first_head, total_heads=total_heads)
        pools.append(pool)
    assert pools[0].data.count_nonzero() > 0
    assert torch.equal(pools[0].data.view(torch.int64), pools[1].data.view(torch.int64))
    for tensor_ops in (False, True):  # and each path accepts the other's stamps
        monkeypatch.setattr(synthetic_kv, "_TENSOR_OPS_ON_CPU", tensor_ops)
        for pool in pools:
            assert synthetic_kv.verify(
                pool, [6, 2, 3], room=(1 << 62) + 5, first_head=first_head, total_heads=total_heads
            )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_pool_is_stamped_as_a_cpu_pool_is():
    gpu = KVPool(LAYOUT, 8, "cuda")
    synthetic_kv.fill(gpu, [6, 2, 3], room=5, first_head=2, total_heads=4)
    cpu = KVPool(LAYOUT, 8)
    cpu.data.copy_(gpu.data.cpu())
    assert synthetic_kv.verify(gpu, [6, 2, 3], room=5, first_head=2, total_heads=4)
    assert synthetic_kv.verify(cpu, [6, 2, 3], room=5, first_head=2, total_heads=4)


def test_a_room_of_many_blocks_is_stamped_as_a_few_are(monkeypatch):
    """Past ``_WORDS_UP_TO`` blocks a CPU pool takes tensor operations; the stamps are the same."""
    pages = list(range(40, 0, -1))
    pools = []
    for limit in (10**9, 4):
        monkeypatch.setattr(synthetic_kv, "_WORDS_UP_TO", limit)
        pool = KVPool(LAYOUT, 48)
        synthetic_kv.fill(pool, pages, room=(1 << 53) - 1, first_head=2, total_heads=4)
        pools.append(pool)
    assert torch.equal(pools[0].data.view(torch.int64), pools[1].data.view(torch.int64))
    assert synthetic_kv.verify(pools[0], pages, room=(1 << 53) - 1, first_head=2, total_heads=4)
    monkeypatch.setattr(synthetic_kv, "_WORDS_UP_TO", 10**9)
    assert synthetic_kv.verify(pools[1], pages, room=(1 << 53) - 1, first_head=2, total_heads=4)
