"""Waiting on a condition, never on the clock alone: the one poll-until of the tests."""

import asyncio
import time
from collections.abc import Callable
from typing import Any


def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """The predicate's first true value, asked every 50 ms; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


async def until_async(predicate: Callable[[], Any], timeout: float = 5.0, what: str = "condition") -> Any:
    """``until`` on an event loop: the loop runs between two looks (every 2 ms)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.002)
    return value
