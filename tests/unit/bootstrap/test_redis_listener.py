"""The Redis store's event listener stops when cancelled, even when the client turns the cancel
into a connection error (what redis-py can do when the cancel lands mid-reconnect)."""

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from bootstrap.redis_store import RedisStore


class Events:
    def __init__(self) -> None:
        self.resyncs = 0

    def resync(self) -> None:
        self.resyncs += 1

    def changed(self, room: int) -> None:
        pass


class CancelTurnedIntoError:
    """A pubsub whose subscribe waits for ever and answers a cancel with a connection error."""

    def __init__(self, entered: asyncio.Event) -> None:
        self.entered = entered

    async def __aenter__(self) -> "CancelTurnedIntoError":
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    async def subscribe(self, channel: str) -> None:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RedisConnectionError("Connection closed by server.") from None


class Channel:
    def __init__(self) -> None:
        self.entered = asyncio.Event()

    def pubsub(self) -> CancelTurnedIntoError:
        return CancelTurnedIntoError(self.entered)


@pytest.mark.timeout(30)
def test_a_cancelled_listener_stops_when_the_client_turns_the_cancel_into_an_error() -> None:
    async def main() -> None:
        store = RedisStore("redis://127.0.0.1:1/0", 10, 60, Events())  # type: ignore[arg-type]
        channel = Channel()
        store._channel = channel  # type: ignore[assignment]
        await store.start()
        await asyncio.wait_for(channel.entered.wait(), 5)
        assert store._listener is not None
        store._listener.cancel()
        done, _ = await asyncio.wait([store._listener], timeout=5)
        assert done, "the listener went on after it was cancelled: close() would wait for ever"
        assert store._listener.cancelled()
        await store._redis.aclose()

    asyncio.run(main())
