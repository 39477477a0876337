"""Synthetic KV for benchmarks: pages stamped with (room, page) instead of model output.

Stamping writes 8 bytes at each end of every page, so preparing a room costs
next to nothing while the whole page still moves; checking the stamps on the
decode side proves each page landed whole and in its place. Both run on the
node's event loop, so a pool in CPU memory is stamped word by word: a few
tensor operations would cost more than the stamps of a hundred pages.
"""

import weakref

import torch

from shared.kv_pool import KVPool

# Tests set this to run the device path on a CPU pool.
_TENSOR_OPS_ON_CPU = False
# Viewing the pool's tensor costs more than stamping a room's pages: views are kept.
_FLAT_WORDS: "weakref.WeakKeyDictionary[KVPool, memoryview]" = weakref.WeakKeyDictionary()


def _first_stamp(room: int) -> int:
    """Page i of the room gets ``first + 2 i`` at its head and ``first + 2 i + 1`` at its tail."""
    return (room * 1_000_003) & ((1 << 62) - 1)


def _words(pool: KVPool) -> torch.Tensor:
    """The pool as rows of 64-bit words, one row a page."""
    return pool.data.view(pool.num_pages, -1).view(torch.int64)


def _flat(pool: KVPool) -> memoryview:
    """A CPU pool's words as one flat sequence of Python ints, made once per pool."""
    flat = _FLAT_WORDS.get(pool)
    if flat is None:
        flat = _FLAT_WORDS[pool] = _words(pool).numpy().data.cast("B").cast("q")
    return flat


def _ends(pool: KVPool, pages: list[int]) -> list[tuple[int, int]]:
    """Index of each page's first and last word in the pool's flat words."""
    per_page = pool.layout.page_bytes // 8
    return [(page * per_page, (page + 1) * per_page - 1) for page in pages]


def _rows_and_heads(words: torch.Tensor, pages: list[int], first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a pool on a device: the page rows and their head stamps, as tensors there."""
    rows = torch.tensor(pages, device=words.device)
    return rows, torch.arange(len(pages), dtype=torch.int64, device=words.device) * 2 + first


def fill(pool: KVPool, pages: list[int], room: int) -> None:
    first = _first_stamp(room)
    if pool.data.is_cpu and not _TENSOR_OPS_ON_CPU:
        flat = _flat(pool)
        for i, (head, tail) in enumerate(_ends(pool, pages)):
            flat[head] = first + 2 * i
            flat[tail] = first + 2 * i + 1
        return
    words = _words(pool)
    rows, heads = _rows_and_heads(words, pages, first)
    words[rows, 0] = heads
    words[rows, -1] = heads + 1


def verify(pool: KVPool, pages: list[int], room: int) -> bool:
    first = _first_stamp(room)
    if pool.data.is_cpu and not _TENSOR_OPS_ON_CPU:
        flat = _flat(pool)
        return all(
            flat[head] == first + 2 * i and flat[tail] == first + 2 * i + 1
            for i, (head, tail) in enumerate(_ends(pool, pages))
        )
    words = _words(pool)
    rows, heads = _rows_and_heads(words, pages, first)
    return bool(torch.equal(words[rows, 0], heads) and torch.equal(words[rows, -1], heads + 1))
