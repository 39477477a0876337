"""Page digests for verify mode: one per page, changed by any change to a word of the range.

Both kinds are held to the same properties; ``wsum`` also to its documented formula,
``xxh3`` to XXH3-64 of the bytes.
"""

import functools
import threading

import pytest
import torch
import xxhash

from shared.kv import digest as kv_digest
from shared.kv.digest import Digester
from shared.kv.layout import KVLayout
from shared.kv.pool import KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4)  # 1024-byte pages
WORDS = LAYOUT.page_bytes // 4
PAGES = [5, 0, 3, 6]


@pytest.fixture(params=["xxh3", "wsum"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def page_digests(kind):
    return functools.partial(kv_digest.page_digests, kind=kind)


@pytest.fixture
def pool() -> KVPool:
    pool = KVPool(LAYOUT, 8)
    g = torch.Generator().manual_seed(7)
    words(pool)[:] = torch.randint(-(1 << 31), 1 << 31, (8, WORDS), generator=g, dtype=torch.int64).to(
        torch.int32
    )
    return pool


def words(pool: KVPool) -> torch.Tensor:
    return pool.data.view(pool.num_pages, -1).view(torch.int32)


def reference(pool: KVPool, page: int, offset: int, length: int) -> int:
    """The documented formula, in plain Python: sum of word i times 2 i + 1, as a signed 64-bit int."""
    values = words(pool)[page, offset // 4 : (offset + length) // 4].tolist()
    total = sum((2 * i + 1) * w for i, w in enumerate(values)) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


def xxh3_reference(pool: KVPool, page: int, offset: int, length: int) -> int:
    data = pool.data.view(pool.num_pages, -1).view(torch.uint8)[page, offset : offset + length]
    value = xxhash.xxh3_64_intdigest(bytes(data.tolist()))
    return value - (1 << 64) if value >= 1 << 63 else value


@pytest.mark.parametrize(("offset", "length"), [(0, LAYOUT.page_bytes), (256, 512), (4, 4)])
def test_one_digest_per_page_as_documented(pool, offset, length):
    wsum = kv_digest.page_digests(pool, PAGES, offset, length, "wsum")
    assert wsum == [reference(pool, p, offset, length) for p in PAGES]
    xxh3 = kv_digest.page_digests(pool, PAGES, offset, length, "xxh3")
    assert xxh3 == [xxh3_reference(pool, p, offset, length) for p in PAGES]
    assert len(set(wsum)) == len(set(xxh3)) == len(PAGES)


def test_a_cpu_pool_digests_with_xxh3_by_default(pool):
    assert kv_digest.kind_for(pool) == "xxh3"
    assert kv_digest.page_digests(pool, PAGES, 0, 64) == kv_digest.page_digests(pool, PAGES, 0, 64, "xxh3")


def test_no_pages_no_digests(pool, page_digests):
    assert page_digests(pool, [], 0, LAYOUT.page_bytes) == []


@pytest.mark.parametrize(
    ("offset", "length"), [(2, 8), (0, 6), (1, 1), (4, 2), (0, 0), (4, LAYOUT.page_bytes)]
)
def test_ranges_must_be_whole_words_inside_a_page(pool, page_digests, offset, length):
    with pytest.raises(ValueError):
        page_digests(pool, PAGES, offset, length)


OFFSET, LENGTH = 256, 512  # words 64 .. 191 of each page
FIRST, LAST = OFFSET // 4, (OFFSET + LENGTH) // 4 - 1


@pytest.mark.parametrize("word", [FIRST, FIRST + 1, 100, LAST - 1, LAST])
@pytest.mark.parametrize("change", ["+1", "bit 31", "negate"])
def test_a_change_to_any_word_changes_that_pages_digest_only(pool, page_digests, word, change):
    before = page_digests(pool, PAGES, OFFSET, LENGTH)
    target = PAGES[2]
    old = int(words(pool)[target, word])
    new = {"+1": old + 1, "bit 31": old ^ (1 << 31), "negate": ~old}[change]
    words(pool)[target, word] = ((new + (1 << 31)) % (1 << 32)) - (1 << 31)
    after = page_digests(pool, PAGES, OFFSET, LENGTH)
    assert after[2] != before[2]
    assert after[:2] + after[3:] == before[:2] + before[3:]


@pytest.mark.parametrize(("a", "b"), [(FIRST, LAST), (FIRST, FIRST + 1), (100, 150)])
def test_swapped_words_change_the_digest(pool, page_digests, a, b):
    target = PAGES[0]
    assert int(words(pool)[target, a]) != int(words(pool)[target, b])
    before = page_digests(pool, [target], OFFSET, LENGTH)
    row = words(pool)[target]
    row[a], row[b] = int(row[b]), int(row[a])
    assert page_digests(pool, [target], OFFSET, LENGTH) != before


def test_swapping_equal_words_is_invisible(pool, page_digests):
    """Of any digest: equal words swapped are the same bytes."""
    row = words(pool)[PAGES[0]]
    row[FIRST + 1] = int(row[FIRST])
    before = page_digests(pool, PAGES, OFFSET, LENGTH)
    row[FIRST], row[FIRST + 1] = int(row[FIRST + 1]), int(row[FIRST])
    assert page_digests(pool, PAGES, OFFSET, LENGTH) == before


@pytest.mark.parametrize("word", [0, FIRST - 1, LAST + 1, WORDS - 1])
def test_bytes_outside_the_range_do_not_matter(pool, page_digests, word):
    before = page_digests(pool, PAGES, OFFSET, LENGTH)
    words(pool)[PAGES[1], word] += 1
    words(pool)[7] = 0  # a page not asked about
    assert page_digests(pool, PAGES, OFFSET, LENGTH) == before


@pytest.mark.parametrize("chunk_words", [1, WORDS // 8, WORDS, 2 * WORDS, 3 * WORDS + 1])
def test_wsum_chunks_give_the_same_digests(pool, monkeypatch, chunk_words):
    """Pages are digested a chunk at a time: any chunk size gives what one pass gives."""
    page_digests = functools.partial(kv_digest.page_digests, kind="wsum")
    pages = [5, 0, 3, 6, 1, 2, 7]
    whole = page_digests(pool, pages, 0, LAYOUT.page_bytes)
    part = page_digests(pool, pages, OFFSET, LENGTH)
    monkeypatch.setattr(kv_digest, "_CHUNK_WORDS", chunk_words)
    assert page_digests(pool, pages, 0, LAYOUT.page_bytes) == whole
    assert page_digests(pool, pages, OFFSET, LENGTH) == part


def test_the_same_page_twice_gives_the_same_digest(pool, page_digests):
    a, b = page_digests(pool, [3, 3], 0, LAYOUT.page_bytes)
    assert a == b


def test_negative_words_give_negative_digests(pool):
    words(pool)[0] = -1
    # The sum of 2 i + 1 is WORDS**2.
    assert kv_digest.page_digests(pool, [0], 0, LAYOUT.page_bytes, "wsum") == [-(WORDS**2)]


def test_sums_wrap_modulo_2_64_into_a_signed_digest():
    """Pages of 2**17 words of 2**31 - 1: the weighted sum passes 2**63 and must wrap as int64."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=256, page_size=256)
    big = KVPool(layout, 1)
    words(big)[0] = (1 << 31) - 1
    count = layout.page_bytes // 4
    assert count**2 * ((1 << 31) - 1) >= 1 << 64
    (digest,) = kv_digest.page_digests(big, [0], 0, layout.page_bytes, "wsum")
    assert digest == reference(big, 0, 0, layout.page_bytes)
    assert -(1 << 63) <= digest < 1 << 63


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_pool_gives_the_digests_of_a_cpu_pool(pool, page_digests):
    gpu = KVPool(LAYOUT, 8, "cuda")
    gpu.data.copy_(pool.data)
    gpu.synchronize()
    assert kv_digest.kind_for(gpu) == "wsum"
    assert page_digests(gpu, PAGES, OFFSET, LENGTH) == page_digests(pool, PAGES, OFFSET, LENGTH)


BIG = KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, page_size=16)  # 32 KiB pages


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("count", [1, 33, 200])
def test_the_digester_gives_what_one_pass_gives(kind, threads, count, monkeypatch):
    """A room above INLINE_BYTES is split over the digester's threads: the same digests, in order."""
    pool = KVPool(BIG, 256)
    pool.data.view(-1).view(torch.uint8)[:] = torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8)
    pages = list(range(255, 255 - count, -1))
    offset, length = BIG.head_bytes, 2 * BIG.head_bytes
    whole = kv_digest.page_digests(pool, pages, offset, length, kind)
    calls = []
    real = kv_digest.page_digests

    def recorded(pool, pages, *args):
        calls.append((threading.current_thread().name.startswith("kv-digest"), len(pages)))
        return real(pool, pages, *args)

    monkeypatch.setattr(kv_digest, "page_digests", recorded)
    digester = Digester(pool, threads)
    try:
        assert digester.start(pages, offset, length, kind).result(10) == whole
    finally:
        digester.close()
    if count * length > kv_digest.INLINE_BYTES:  # wsum of a CPU pool too: slow there, off the caller
        step = -(-count // threads)
        assert sorted(calls) == sorted((True, min(step, count - at)) for at in range(0, count, step))
    else:
        assert calls == [(False, count)]


def test_the_digester_says_when_a_part_failed():
    pool = KVPool(BIG, 64)
    digester = Digester(pool, 2)
    try:
        with pytest.raises(IndexError):
            digester.start([0, 1, 2, 500] * 16, 0, BIG.page_bytes).result(10)
        with pytest.raises(ValueError):
            digester.start([0], 2, 8).result(10)
    finally:
        digester.close()
