"""Synthetic KV for benchmarks: pages stamped instead of computed by a model.

Each head block of a page (one head's K and V for every layer) gets 8 bytes
at each end that name the room, the page's place in the room and the head, so
preparing a room costs next to nothing while every byte still moves; checking
the stamps on the decode side proves each block landed whole and in its place,
whichever prefill rank wrote it. Both run on the node's event loop, so a pool
in CPU memory is stamped word by word: a few tensor operations would cost more
than the stamps of a hundred pages.
"""

import weakref

import torch

from shared.kv_pool import KVPool

# Tests set this to run the device path on a CPU pool.
_TENSOR_OPS_ON_CPU = False
# Viewing the pool's tensor costs more than stamping a room's pages: views are kept.
_FLAT_WORDS: "weakref.WeakKeyDictionary[KVPool, memoryview]" = weakref.WeakKeyDictionary()


def _stamp(room: int, index: int, head: int, total_heads: int) -> int:
    """Block ``head`` of page ``index`` of the room gets this at its head and this + 1 at its tail."""
    return ((room * 1_000_003) + 2 * (index * total_heads + head)) & ((1 << 62) - 1)


def _flat(pool: KVPool) -> memoryview:
    """A CPU pool's words as one flat sequence of Python ints, made once per pool."""
    flat = _FLAT_WORDS.get(pool)
    if flat is None:
        words = pool.data.view(pool.num_pages, -1).view(torch.int64)
        flat = _FLAT_WORDS[pool] = words.numpy().data.cast("B").cast("q")
    return flat


def _blocks(pool: KVPool, pages: list[int], first_head: int, total_heads: int, room: int):
    """(head word index, tail word index, stamp) for every head block of the room's pages."""
    per_head = pool.layout.head_bytes // 8
    per_page = pool.layout.page_bytes // 8
    for index, page in enumerate(pages):
        for local in range(pool.layout.num_kv_heads):
            head = page * per_page + local * per_head
            yield head, head + per_head - 1, _stamp(room, index, first_head + local, total_heads)


def fill(pool: KVPool, pages: list[int], room: int, first_head: int = 0, total_heads: int = 0) -> None:
    """Stamp the room's pages; this rank holds heads ``first_head`` on, of ``total_heads``."""
    total = total_heads or pool.layout.num_kv_heads
    if pool.data.is_cpu and not _TENSOR_OPS_ON_CPU:
        flat = _flat(pool)
        for head, tail, stamp in _blocks(pool, pages, first_head, total, room):
            flat[head] = stamp
            flat[tail] = stamp + 1
        return
    words = pool.data.view(-1).view(torch.int64)
    heads, tails, stamps = _tensors(pool, pages, first_head, total, room)
    words[heads] = stamps
    words[tails] = stamps + 1


def verify(pool: KVPool, pages: list[int], room: int, first_head: int = 0, total_heads: int = 0) -> bool:
    total = total_heads or pool.layout.num_kv_heads
    if pool.data.is_cpu and not _TENSOR_OPS_ON_CPU:
        flat = _flat(pool)
        return all(
            flat[head] == stamp and flat[tail] == stamp + 1
            for head, tail, stamp in _blocks(pool, pages, first_head, total, room)
        )
    words = pool.data.view(-1).view(torch.int64)
    heads, tails, stamps = _tensors(pool, pages, first_head, total, room)
    return bool(torch.equal(words[heads], stamps) and torch.equal(words[tails], stamps + 1))


def _tensors(
    pool: KVPool, pages: list[int], first_head: int, total: int, room: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a pool on a device: the blocks' word indices and stamps, as tensors there."""
    heads, tails, stamps = zip(*_blocks(pool, pages, first_head, total, room), strict=True)
    device = pool.data.device
    return (
        torch.tensor(heads, device=device),
        torch.tensor(tails, device=device),
        torch.tensor(stamps, dtype=torch.int64, device=device),
    )
