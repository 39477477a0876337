import pytest

from shared.errors import PoolExhausted
from shared.kv_layout import KVLayout
from shared.kv_pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, page_size=16)


def test_page_bytes_and_addresses():
    pool = KVPool(LAYOUT, 8)
    assert LAYOUT.page_bytes == 2 * 2 * 16 * 4 * 16 * 4
    assert pool.nbytes == 8 * LAYOUT.page_bytes == pool.data.numel() * pool.data.element_size()
    assert pool.page_ptr(3) == pool.base_ptr + 3 * LAYOUT.page_bytes
    assert pool.data[3].data_ptr() == pool.page_ptr(3)
    with pytest.raises(IndexError):
        pool.page_ptr(8)
    with pytest.raises(IndexError):
        pool.page_ptr(-1)


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


def test_exhaustion_takes_nothing():
    pool = KVPool(LAYOUT, 4)
    with pytest.raises(PoolExhausted):
        pool.alloc(5)
    assert pool.free_pages == 4


def test_layout_mismatch_names_the_field():
    assert LAYOUT.mismatch(LAYOUT) is None
    other = KVLayout(num_layers=2, num_kv_heads=4, head_dim=16, page_size=32)
    assert "page_size" in LAYOUT.mismatch(other)
    assert LAYOUT.pages_for(1) == 1 and LAYOUT.pages_for(16) == 1 and LAYOUT.pages_for(17) == 2


def test_freed_pages_are_reused_first_and_stay_one_run():
    pool = KVPool(LAYOUT, 16)
    a = pool.alloc(4)
    b = pool.alloc(4)
    pool.free(a)
    assert pool.alloc(4) == a  # warm pages first, still consecutive
    pool.free(b)
    assert pool.alloc(2) == b[:2]


def test_scattered_pools_break_runs():
    pool = KVPool(LAYOUT, 64, scatter=True)
    pages = pool.alloc(16)
    assert sorted(pages) != pages and len(set(pages)) == 16
