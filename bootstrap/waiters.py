"""Who waits on a room: woken whenever the store tells of a change to it, here or on another bootstrap."""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from bootstrap.store import RoomData, Store
from shared.wire.protocol import RoomId


class Waiters:
    """The store's ``RoomEvents``: each waiter holds an event, set when its room changes."""

    def __init__(self) -> None:
        self._events: dict[RoomId, set[asyncio.Event]] = {}

    def changed(self, room: RoomId) -> None:
        for event in self._events.get(room, ()):
            event.set()

    def resync(self) -> None:
        """Changes may have gone unheard: every waiter reads its room again."""
        for waiting in self._events.values():
            for event in waiting:
                event.set()

    @contextlib.asynccontextmanager
    async def watching(self, room: RoomId) -> AsyncIterator[asyncio.Event]:
        """An event set whenever the room changes, while the block runs."""
        event = asyncio.Event()
        self._events.setdefault(room, set()).add(event)
        try:
            yield event
        finally:
            waiting = self._events[room]
            waiting.discard(event)
            if not waiting:
                del self._events[room]

    async def wait(
        self, store: Store, room_id: RoomId, seconds: float, until: Callable[[RoomData], bool]
    ) -> RoomData | None:
        """The room once ``until`` holds for it, or as it is when ``seconds`` ran out."""
        deadline = time.monotonic() + seconds
        async with self.watching(room_id) as event:
            while True:
                event.clear()
                room = await store.room(room_id)
                left = deadline - time.monotonic()
                if room is None or until(room) or left <= 0:
                    return room
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
