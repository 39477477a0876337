"""Digests of KV pages, for verify mode: computed where the pages live, the same on every device.

The digest of a byte range is the sum of its 32-bit words, each times an odd
weight (2 i + 1 for word i), modulo 2**64 (as a signed 64-bit integer). A change to any one word changes
the sum (an odd weight times a non-zero difference is never 0 modulo 2**64),
and swapped words change it too unless they were equal. It is integer
arithmetic, so a CUDA pool and a CPU pool give the same digest of the same
bytes, and it is a handful of tensor operations for a whole room.
"""

import torch

from shared.kv_pool import KVPool

# Words digested at once: bounds the temporary int64 copies at 64 MiB.
_CHUNK_WORDS = 8 << 20


def page_digests(pool: KVPool, pages: list[int], offset: int, length: int) -> list[int]:
    """One digest per page of ``pages``, over ``length`` bytes at ``offset`` of the page."""
    if offset % 4 or length % 4:
        raise ValueError("page digests cover whole 32-bit words")
    if not pages:
        return []
    words = pool.data.view(pool.num_pages, -1).view(torch.int32)
    first, count = offset // 4, length // 4
    weights = torch.arange(count, dtype=torch.int64, device=words.device) * 2 + 1
    per_chunk = max(1, _CHUNK_WORDS // count)
    out: list[int] = []
    for at in range(0, len(pages), per_chunk):
        rows = torch.tensor(pages[at : at + per_chunk], device=words.device)
        block = words[rows, first : first + count].to(torch.int64)
        out += (block * weights).sum(dim=1).tolist()
    return out
