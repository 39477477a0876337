"""Head-major KV pages, and the writes that move a head range of each page between ranks."""

import pytest
import torch

from shared.kv.layout import MAX_WRITE_BYTES, KVLayout, plan_writes
from shared.kv.pool import torch_dtype

LAYOUT = KVLayout(num_layers=3, num_kv_heads=4, head_dim=16, page_size=8, dtype="float16")
PB = 100


def test_pages_are_head_major():
    assert LAYOUT.page_shape == (4, 3, 2, 8, 16)  # (heads, layers, K/V, tokens, head_dim)
    assert torch_dtype(LAYOUT.dtype) is torch.float16


def test_head_and_page_bytes():
    assert LAYOUT.head_bytes == 3 * 2 * 8 * 16 * 2
    assert LAYOUT.page_bytes == 4 * LAYOUT.head_bytes
    assert LAYOUT.page_bytes == torch.zeros(LAYOUT.page_shape, dtype=torch_dtype(LAYOUT.dtype)).nbytes
    wide = KVLayout(num_layers=3, num_kv_heads=4, head_dim=16, page_size=8, dtype="float64")
    assert wide.head_bytes == 4 * LAYOUT.head_bytes


def test_a_head_block_is_contiguous_in_a_page():
    """Head h of a page is bytes [h * head_bytes, (h + 1) * head_bytes): one write per head range."""
    page = torch.zeros(LAYOUT.page_shape, dtype=torch_dtype(LAYOUT.dtype))
    page[2] = 1
    flat = page.view(-1).view(torch.uint8)
    nonzero = flat.nonzero().flatten()
    per_head = LAYOUT.head_bytes
    assert int(nonzero.min()) >= 2 * per_head and int(nonzero.max()) < 3 * per_head


def test_pages_for_and_with_heads():
    assert [LAYOUT.pages_for(n) for n in (1, 8, 9, 16, 17)] == [1, 1, 2, 2, 3]
    half = LAYOUT.with_heads(2)
    assert half.num_kv_heads == 2 and half.page_bytes == LAYOUT.page_bytes // 2
    assert half.head_bytes == LAYOUT.head_bytes and LAYOUT.num_kv_heads == 4


def whole(src_pages, dst_pages, src_base=0, dst_base=0, max_bytes=MAX_WRITE_BYTES):
    """Whole pages of the same size on both sides."""
    return plan_writes(src_base, PB, src_pages, dst_base, PB, dst_pages, 0, 0, PB, max_bytes)


def test_contiguous_pages_become_one_write():
    assert whole([0, 1, 2, 3], [4, 5, 6, 7], 1000, 5000) == [(1000, 5400, 400)]


def test_runs_break_where_either_side_jumps():
    assert whole([0, 1, 2, 3, 4], [10, 11, 20, 21, 22]) == [(0, 1000, 200), (200, 2000, 300)]
    assert whole([0, 5, 6], [1, 2, 3]) == [(0, 100, 100), (500, 200, 200)]


def test_scattered_pages_give_one_write_each():
    assert whole([0, 1, 2], [9, 5, 1]) == [(0, 900, 100), (100, 500, 100), (200, 100, 100)]
    assert whole([2, 1, 0], [0, 1, 2]) == [(200, 0, 100), (100, 100, 100), (0, 200, 100)]


def test_empty_and_mismatched():
    assert whole([], []) == []
    with pytest.raises(ValueError):
        whole([1], [])
    with pytest.raises(ValueError):
        whole([], [1])


def test_long_runs_are_cut_at_the_write_limit():
    assert whole([0, 1, 2, 3, 4], [0, 1, 2, 3, 4], 0, 1000, max_bytes=200) == [
        (0, 1000, 200),
        (200, 1200, 200),
        (400, 1400, 100),
    ]
    # Pages larger than the limit are cut too: a write is only a byte range.
    assert whole([0, 1], [5, 6], 0, 1000, max_bytes=80) == [(0, 1500, 80), (80, 1580, 80), (160, 1660, 40)]
    assert whole([0, 1], [0, 1], max_bytes=200) == [(0, 0, 200)]  # exactly the limit: one write


def test_a_head_sub_range_is_one_write_per_page():
    """Prefill pages of 4 heads (400 bytes), decode pages of 2 (200 bytes): heads 2-3 of each
    source page go to the whole of each destination page, and consecutive pages do not merge."""
    writes = plan_writes(0, 400, [0, 1, 2], 10_000, 200, [0, 1, 2], 200, 0, 200)
    assert writes == [(200, 10_000, 200), (600, 10_200, 200), (1000, 10_400, 200)]


def test_a_sub_range_on_the_destination_side():
    """Pages of 2 heads written into heads 1-2 of pages of 4: the offset is applied per page."""
    writes = plan_writes(0, 200, [0, 1], 10_000, 400, [3, 4], 0, 100, 200)
    assert writes == [(0, 11_300, 200), (200, 11_700, 200)]


def test_only_ranges_that_fill_their_page_on_both_sides_merge():
    """Whole 200-byte source pages into the last 200 bytes of 300-byte pages: the source run is
    contiguous, the destination is not, so one write per page; whole pages on both sides merge."""
    assert plan_writes(0, 200, [0, 1], 0, 300, [0, 1], 0, 100, 200) == [(0, 100, 200), (200, 400, 200)]
    assert plan_writes(0, 200, [3, 4], 50, 200, [1, 2], 0, 0, 200) == [(600, 250, 400)]


def test_a_room_takes_its_prompts_pages_on_a_prefill_and_every_fed_back_token_on_a_decode():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=16)
    assert layout.room_pages("prefill", 16, 100) == 1
    assert layout.room_pages("decode", 16, 1) == 1  # the last token is never fed back
    assert layout.room_pages("decode", 16, 2) == 2
    assert layout.room_pages("prefill", 17, 0) == layout.room_pages("decode", 17, 1) == 2
