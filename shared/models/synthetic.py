"""Synthetic KV for benchmarks: pages stamped instead of computed by a model.

Each head block of a page (one head's K and V for every layer) gets 8 bytes
at each end that name the room, the page's place in the room and the head, so
preparing a room costs next to nothing while every byte still moves; checking
the stamps on the decode side proves each block landed whole and in its place,
whichever prefill rank wrote it. Both run on the node's event loop, so a room
of a few blocks in CPU memory is stamped word by word (a few tensor operations
would cost more); many blocks, or a pool on a device, take tensor operations.
"""

import weakref

import numpy as np
import torch

from shared.kv.pool import KVPool

# Tests set this to run the device path on a CPU pool.
_TENSOR_OPS_ON_CPU = False
# Up to this many head blocks, Python's loop beats array operations on a CPU pool.
_WORDS_UP_TO = 32
_MASK = (1 << 62) - 1
# Viewing the pool's tensor costs more than stamping a room's pages: views are kept.
_VIEWS: "weakref.WeakKeyDictionary[KVPool, tuple[np.ndarray, memoryview]]" = weakref.WeakKeyDictionary()


def _stamp(room: int, index: int, head: int, total_heads: int) -> int:
    """Block ``head`` of page ``index`` of the room gets this at its head and this + 1 at its tail."""
    return ((room * 1_000_003) + 2 * (index * total_heads + head)) & _MASK


def _views(pool: KVPool) -> tuple[np.ndarray, memoryview]:
    """A CPU pool's 64-bit words as a numpy array and as a memoryview of Python ints, made once."""
    views = _VIEWS.get(pool)
    if views is None:
        words = pool.data.view(-1).view(torch.int64).numpy()
        views = _VIEWS[pool] = (words, words.data.cast("B").cast("q"))
    return views


def _blocks(pool: KVPool, pages: list[int], first_head: int, total_heads: int, room: int):
    """(head word index, tail word index, stamp) for every head block of the room's pages."""
    per_head = pool.layout.head_bytes // 8
    per_page = pool.layout.page_bytes // 8
    for index, page in enumerate(pages):
        for local in range(pool.layout.num_kv_heads):
            head = page * per_page + local * per_head
            yield head, head + per_head - 1, _stamp(room, index, first_head + local, total_heads)


def _arrays(
    pool: KVPool, pages: list[int], first_head: int, total: int, room: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What ``_blocks`` gives, as three int64 arrays."""
    n, per_head, per_page = pool.layout.num_kv_heads, pool.layout.head_bytes // 8, pool.layout.page_bytes // 8
    page = np.asarray(pages, dtype=np.int64).repeat(n)
    index = np.arange(len(pages), dtype=np.int64).repeat(n)
    local = np.tile(np.arange(n, dtype=np.int64), len(pages))
    heads = page * per_page + local * per_head
    # Below 2**62 before the sum, so int64 never overflows; the same value as _stamp.
    stamps = (((room * 1_000_003) & _MASK) + 2 * (index * total + first_head + local)) & _MASK
    return heads, heads + (per_head - 1), stamps


def _where(pool: KVPool, pages: list[int]) -> str:
    if not pool.data.is_cpu or _TENSOR_OPS_ON_CPU:
        return "tensors"
    return "words" if len(pages) * pool.layout.num_kv_heads <= _WORDS_UP_TO else "arrays"


def fill(pool: KVPool, pages: list[int], room: int, first_head: int = 0, total_heads: int = 0) -> None:
    """Stamp the room's pages; this rank holds heads ``first_head`` on, of ``total_heads``."""
    total = total_heads or pool.layout.num_kv_heads
    how = _where(pool, pages)
    if how == "words":
        flat = _views(pool)[1]
        for head, tail, stamp in _blocks(pool, pages, first_head, total, room):
            flat[head] = stamp
            flat[tail] = stamp + 1
        return
    heads, tails, stamps = _arrays(pool, pages, first_head, total, room)
    if how == "arrays":
        words = _views(pool)[0]
        words[heads], words[tails] = stamps, stamps + 1
        return
    device_words = pool.data.view(-1).view(torch.int64)
    h, t, s = (torch.from_numpy(a).to(pool.data.device) for a in (heads, tails, stamps))
    device_words[h], device_words[t] = s, s + 1


def verify(pool: KVPool, pages: list[int], room: int, first_head: int = 0, total_heads: int = 0) -> bool:
    total = total_heads or pool.layout.num_kv_heads
    how = _where(pool, pages)
    if how == "words":
        flat = _views(pool)[1]
        return all(
            flat[head] == stamp and flat[tail] == stamp + 1
            for head, tail, stamp in _blocks(pool, pages, first_head, total, room)
        )
    heads, tails, stamps = _arrays(pool, pages, first_head, total, room)
    if how == "arrays":
        words = _views(pool)[0]
        return bool(np.array_equal(words[heads], stamps) and np.array_equal(words[tails], stamps + 1))
    device_words = pool.data.view(-1).view(torch.int64)
    h, t, s = (torch.from_numpy(a).to(pool.data.device) for a in (heads, tails, stamps))
    return bool(torch.equal(device_words[h], s) and torch.equal(device_words[t], s + 1))
