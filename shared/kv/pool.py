"""A pool of KV pages in one registered memory region, with a free list."""

import collections
import functools
import logging
import random

import torch

from shared.errors import PagesStillLent, PoolExhausted
from shared.kv.layout import KVLayout
from shared.kv.lease import Lease, LeaseState

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout's dtype name (the layout itself stays free of torch)."""
    dtype: torch.dtype = getattr(torch, name)
    return dtype


class KVPool:
    """``num_pages`` pages of ``layout.page_shape`` in one contiguous tensor.

    Pages are handed out from the front of a free list that starts in order,
    and freed pages return to the front: consecutive runs stay consecutive and
    coalesce into few transfers, and recently used (cache-warm) pages go first.
    """

    def __init__(self, layout: KVLayout, num_pages: int, device: str = "cpu", scatter: bool = False):
        if num_pages < 1:
            raise ValueError("a KV pool needs at least one page")
        self.layout = layout
        self.num_pages = num_pages
        self.data = torch.zeros(
            (num_pages, *layout.page_shape), dtype=torch_dtype(layout.dtype), device=device
        )
        order = list(range(num_pages))
        if scatter:  # for benchmarks: every allocation breaks into short runs
            random.Random(num_pages).shuffle(order)
        self._free: collections.deque[int] = collections.deque(order)
        self._scatter = scatter
        self._used: set[int] = set()
        self._lent: collections.Counter[int] = collections.Counter()  # page -> open leases on it
        # Pages of leases that closed, by how: returned by their writer, revoked because it is
        # gone for certain, or expired with no word from it.
        self.closed_lent_pages: collections.Counter[LeaseState] = collections.Counter()

    @property
    def base_ptr(self) -> int:
        return self.data.data_ptr()

    @functools.cached_property
    def host_bytes(self) -> memoryview:
        """A CPU pool's bytes, one flat view that slices without copying."""
        if self.data.is_cuda:
            raise ValueError("a CUDA pool's bytes are not in host memory")
        return self.data.view(-1).view(torch.uint8).numpy().data

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.layout.page_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def synchronize(self) -> None:
        """Wait for device work that writes the pool: its pages go to the engine, which does not."""
        if self.data.is_cuda:
            torch.cuda.synchronize(self.data.device)

    def page_ptr(self, page: int) -> int:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside pool of {self.num_pages}")
        return self.base_ptr + page * self.layout.page_bytes

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._used.update(pages)
        return pages

    def lend(self, transfer: int, peer_rank: int, pages: list[int]) -> Lease:
        """Lend pages in use to a peer rank's writes: they cannot be freed while the lease is open."""
        lease = Lease(transfer, peer_rank, tuple(pages), self._lease_closed)
        self._lent.update(lease.pages)
        return lease

    def _lease_closed(self, lease: Lease) -> None:
        self.closed_lent_pages[lease.state] += len(lease.pages)
        self._lent.subtract(lease.pages)
        for page in lease.pages:
            if self._lent[page] <= 0:
                del self._lent[page]

    def lent(self, page: int) -> bool:
        return page in self._lent

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise ValueError(f"page {page} freed but not in use")
            if page in self._lent:
                raise PagesStillLent(f"page {page} freed while a peer's write may still land in it")
        self._used.difference_update(pages)
        if self._scatter:
            self._free.extend(pages)
        else:
            # Freed pages go to the front, in order: the next room reuses them while they
            # are still in cache, as one run if they were one.
            self._free.extendleft(sorted(pages, reverse=True))
