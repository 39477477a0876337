"""Digests of KV pages, for verify mode: one signed 64-bit digest per page range, at memory speed.

Two kinds, and each done+aux names the one its digests are of, so both ends
always compute the same:

- ``xxh3``: XXH3-64 of the bytes, what a CPU pool uses. It runs at 11-20 GB/s
  on one core, about as fast as memory, and releases the GIL: the prefill
  digests its pages while their writes are out, and a host with cores to spare
  splits a large room over a few threads.
- ``wsum``: the sum of the range's 32-bit words, word i times 2 i + 1, modulo
  2**64: a handful of tensor operations, what a CUDA pool uses, computed on the
  device. A change to one word changes it (an odd weight times a non-zero
  difference is never 0 modulo 2**64); swapped words change it unless equal.

Either kind can be computed on either device (xxh3 of a CUDA pool copies the
pages to the host first), so a CPU node and a CUDA node still check each other.
"""

import concurrent.futures
import os
import threading

import torch
import xxhash

from shared.kv.digest_kind import DigestKind
from shared.kv.pool import KVPool

# Below this many bytes a room is digested at once where it is asked for: a thread hop costs
# more than the digest (256 KiB take about 15 us).
INLINE_BYTES = 1 << 20
# Words of one wsum step: bounds the temporary int64 copies at 64 MiB.
_CHUNK_WORDS = 8 << 20
_SIGN = 1 << 63


def kind_for(pool: KVPool) -> DigestKind:
    """The kind a pool's own digests are of: computed where its pages live."""
    return "wsum" if pool.data.is_cuda else "xxh3"


def page_digests(
    pool: KVPool, pages: list[int], offset: int, length: int, kind: DigestKind | None = None
) -> list[int]:
    """One digest per page of ``pages``, over ``length`` bytes at ``offset`` of the page."""
    if offset % 4 or length % 4 or length <= 0 or offset + length > pool.layout.page_bytes:
        raise ValueError("page digests cover whole 32-bit words inside a page")
    if pages and (min(pages) < 0 or max(pages) >= pool.num_pages):
        raise IndexError(f"a page outside the pool of {pool.num_pages}")
    if (kind or kind_for(pool)) == "wsum":
        return _wsum(pool, pages, offset, length)
    return _xxh3(pool, pages, offset, length)


def _xxh3(pool: KVPool, pages: list[int], offset: int, length: int) -> list[int]:
    if pool.data.is_cuda:
        rows = torch.tensor(pages, dtype=torch.long, device=pool.data.device)
        flat = pool.data.view(pool.num_pages, -1).view(torch.uint8)
        data = flat[rows, offset : offset + length].cpu().view(-1).numpy().data
        pages, offset, step = list(range(len(pages))), 0, length
    else:
        data, step = pool.host_bytes, pool.layout.page_bytes
    digest = xxhash.xxh3_64_intdigest
    out = []
    for page in pages:
        at = page * step + offset
        value = digest(data[at : at + length])
        out.append(value - (1 << 64) if value >= _SIGN else value)
    return out


def _wsum(pool: KVPool, pages: list[int], offset: int, length: int) -> list[int]:
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


class Digester:
    """A pool's page digests, at once for a small room, else split over a few threads.

    ``start`` returns a future: the prefill starts its digests, hands the writes to
    the engine, and takes the digests once the writes ended.
    """

    def __init__(self, pool: KVPool, threads: int | None = None):
        self.pool = pool
        self.kind = kind_for(pool)
        # XXH3 is bound by memory bandwidth: on a host of two cores (or two hyperthreads of
        # one) a second thread makes a large room's digests slower, not faster.
        self._threads = max(1, threads or min(4, len(os.sched_getaffinity(0)) // 4))
        self._executor = concurrent.futures.ThreadPoolExecutor(self._threads, "kv-digest")

    def start(
        self, pages: list[int], offset: int, length: int, kind: DigestKind | None = None
    ) -> "concurrent.futures.Future[list[int]]":
        kind = kind or self.kind
        if self.pool.data.is_cuda:
            # A few kernels, but reading their result waits for the device's stream, where the
            # model's work may be queued: never on the caller's thread (an event loop).
            return self._executor.submit(page_digests, self.pool, pages, offset, length, kind)
        if len(pages) * length <= INLINE_BYTES:
            done: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
            try:
                done.set_result(page_digests(self.pool, pages, offset, length, kind))
            except Exception as exc:
                done.set_exception(exc)
            return done
        step = -(-len(pages) // self._threads)
        parts = [
            self._executor.submit(page_digests, self.pool, pages[at : at + step], offset, length, kind)
            for at in range(0, len(pages), step)
        ]
        return _joined(parts)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _joined(parts: list["concurrent.futures.Future[list[int]]"]) -> "concurrent.futures.Future[list[int]]":
    """One future for the parts' digests in order, done when the last part is."""
    joined: concurrent.futures.Future[list[int]] = concurrent.futures.Future()
    left = [len(parts)]
    lock = threading.Lock()

    def part_done(_: object) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            joined.set_result([d for part in parts for d in part.result()])
        except Exception as exc:
            joined.set_exception(exc)

    for part in parts:
        part.add_done_callback(part_done)
    return joined
