"""The KV page pool: addresses, the free list, and who may free what."""

import pytest
import torch

from shared.errors import PoolExhausted
from shared.kv.layout import KVLayout
from shared.kv.pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, page_size=16)


def test_page_bytes_and_addresses():
    pool = KVPool(LAYOUT, 8)
    assert pool.data.shape == (8, 4, 2, 2, 16, 16) and pool.data.dtype is torch.float32
    assert LAYOUT.page_bytes == 4 * 2 * 2 * 16 * 16 * 4
    assert pool.nbytes == 8 * LAYOUT.page_bytes == pool.data.numel() * pool.data.element_size()
    assert pool.page_ptr(3) == pool.base_ptr + 3 * LAYOUT.page_bytes
    assert pool.data[3].data_ptr() == pool.page_ptr(3)
    assert pool.data.is_contiguous()
    with pytest.raises(IndexError):
        pool.page_ptr(8)
    with pytest.raises(IndexError):
        pool.page_ptr(-1)


def test_at_least_one_page():
    with pytest.raises(ValueError):
        KVPool(LAYOUT, 0)


def test_alloc_free_and_exhaustion():
    pool = KVPool(LAYOUT, 8)
    first = pool.alloc(3)
    assert first == [0, 1, 2]  # a fresh pool hands out consecutive runs
    rest = pool.alloc(5)
    assert pool.free_pages == 0
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    pool.free(first)
    assert pool.free_pages == 3
    pool.free(rest)
    assert pool.free_pages == 8
    assert sorted(pool.alloc(8)) == list(range(8))


def test_double_free_and_foreign_pages_are_refused():
    pool = KVPool(LAYOUT, 4)
    pages = pool.alloc(2)
    pool.free(pages)
    with pytest.raises(ValueError):
        pool.free(pages)
    with pytest.raises(ValueError):
        pool.free([99])
    assert pool.free_pages == 4


def test_a_refused_free_frees_nothing():
    pool = KVPool(LAYOUT, 4)
    pages = pool.alloc(2)
    with pytest.raises(ValueError):
        pool.free([pages[0], 99])
    assert pool.free_pages == 2
    pool.free(pages)  # both were still in use
    assert pool.free_pages == 4


def test_exhaustion_takes_nothing():
    pool = KVPool(LAYOUT, 4)
    with pytest.raises(PoolExhausted):
        pool.alloc(5)
    assert pool.free_pages == 4


def test_freed_pages_are_reused_first_and_stay_one_run():
    pool = KVPool(LAYOUT, 16)
    a = pool.alloc(4)
    b = pool.alloc(4)
    pool.free(a)
    assert pool.alloc(4) == a  # warm pages first, still consecutive
    pool.free(b)
    assert pool.alloc(2) == b[:2]
    pool.free([5, 4])
    assert pool.alloc(2) == [4, 5]  # in order, whatever order they were freed in


def test_scattered_pools_break_runs():
    pool = KVPool(LAYOUT, 64, scatter=True)
    pages = pool.alloc(16)
    assert sorted(pages) != pages and len(set(pages)) == 16


def test_synchronize_is_a_no_op_on_cpu(monkeypatch):
    def no_cuda(*args: object) -> None:
        raise AssertionError("a CPU pool must not wait for CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", no_cuda)
    pool = KVPool(LAYOUT, 2)
    pool.data[1] = 3.0
    pool.synchronize()
    assert bool((pool.data[1] == 3.0).all()) and not bool(pool.data[0].any())
