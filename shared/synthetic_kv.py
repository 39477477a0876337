"""Synthetic KV for benchmarks: pages stamped with (room, page) instead of model output.

Stamping writes 8 bytes at each end of every page, so preparing a room costs
next to nothing while the whole page still moves; checking the stamps on the
decode side proves each page landed whole and in its place.
"""

import torch

from shared.kv_pool import KVPool


def _stamps(room: int, count: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    base = (room * 1_000_003) & ((1 << 62) - 1)
    index = torch.arange(count, dtype=torch.int64, device=device) * 2 + base
    return index, index + 1


def _words(pool: KVPool) -> torch.Tensor:
    """The pool as rows of 64-bit words, one row a page."""
    return pool.data.view(pool.num_pages, -1).view(torch.int64)


def fill(pool: KVPool, pages: list[int], room: int) -> None:
    words = _words(pool)
    rows = torch.tensor(pages, device=words.device)
    head, tail = _stamps(room, len(pages), words.device)
    words[rows, 0] = head
    words[rows, -1] = tail


def verify(pool: KVPool, pages: list[int], room: int) -> bool:
    words = _words(pool)
    rows = torch.tensor(pages, device=words.device)
    head, tail = _stamps(room, len(pages), words.device)
    return bool(torch.equal(words[rows, 0], head) and torch.equal(words[rows, -1], tail))
