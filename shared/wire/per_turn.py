"""Messages for one peer gathered over one turn of the event loop, and sent together at its end.

Under load one turn of a service's loop handles several rooms (they arrive together, answered
together), and every ZMQ message costs a thread wake-up on both ends: on a small host those
wake-ups are a large share of a room's CPU. A turn with one room sends one item, as before.
"""

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import Generic, TypeVar

from shared.wire import protocol

T = TypeVar("T")


class PerTurn(Generic[T]):
    def __init__(self, send: Callable[[protocol.PeerRank, list[T]], object]):
        """``send(peer, items)`` is called once a turn for each peer given items, in their order."""
        self._send = send
        self._pending: dict[tuple[str, str], tuple[protocol.PeerRank, list[T]]] = {}
        self._flushed: asyncio.Future[None] | None = None

    def add(self, peer: protocol.PeerRank, item: T) -> None:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        key = (peer.zmq_endpoint, peer.public_key)
        if key not in self._pending:
            self._pending[key] = (peer, [])
        self._pending[key][1].append(item)

    async def flushed(self) -> None:
        """Until what was added this turn has been handed to ``send``."""
        if not self._pending:
            return
        if self._flushed is None:  # made only for a turn someone waits on
            self._flushed = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._flushed)

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        flushed, self._flushed = self._flushed, None
        try:
            for peer, items in pending.values():
                self._send(peer, items)
        finally:
            if flushed is not None and not flushed.done():
                flushed.set_result(None)


def chunks(
    items: Iterable[T], weight: Callable[[T], int], max_items: int, max_weight: int
) -> Iterator[list[T]]:
    """``items`` in order, cut into runs of at most ``max_items`` and ``max_weight`` (an item
    heavier than that alone goes alone): each run one message within a receiver's limits."""
    run: list[T] = []
    total = 0
    for item in items:
        w = weight(item)
        if run and (len(run) >= max_items or total + w > max_weight):
            yield run
            run, total = [], 0
        run.append(item)
        total += w
    if run:
        yield run
