"""Work the bootstrap starts from callbacks (a report came, a connection dropped, a room is placed
again): each task is held until it ends, a failure is logged, and all are cancelled at close."""

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from bootstrap.store import StoreUnavailable

log = logging.getLogger(__name__)


class Tasks:
    def __init__(self) -> None:
        self._running: set[asyncio.Future[Any]] = set()
        self._store_failed = False

    def spawn(self, work: Awaitable[Any]) -> "asyncio.Future[Any]":
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: "asyncio.Future[Any]") -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            if isinstance(exc, StoreUnavailable):
                log.warning("store unavailable: %s", exc)
                self._store_failed = True
            else:
                log.error("task failed", exc_info=exc)

    def store_failed(self) -> bool:
        """Whether a task failed on the store since the last ask: a report it held may be lost, so
        the nodes must report again."""
        failed, self._store_failed = self._store_failed, False
        return failed

    def cancel(self) -> None:
        for task in list(self._running):
            task.cancel()
