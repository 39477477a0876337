"""A node with one thing broken on purpose, for fault tests: ``python -m tests.integration.hooked_node``.

``KVROOM_TEST_ROLE`` (prefill or decode) picks the node, ``KVROOM_TEST_HOOK`` what breaks:

- ``break-decode``: the model raises while decoding a room whose prompt is 13 tokens long.
- ``corrupt-kv``: one byte of a page a room's KV landed in (``KVROOM_TEST_CORRUPT_PAGE``: its
  index among the room's pages, -1 the last; the first by default) is changed after the write,
  before the decode digests the pages (verify mode catches it).
- ``late-write``: the first KV write is held back by the engine until the file
  ``KVROOM_TEST_RELEASE_FILE`` exists (long after the node gave up on it), then moves for
  real, into the pages it was meant for.

Everything else is the real node, the real engine, real sockets.
"""

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from shared.kv import digest as kv_digest
from shared.kv import transfer
from shared.models import source as kv_source

HOOK = os.environ.get("KVROOM_TEST_HOOK", "")
ROLE = os.environ.get("KVROOM_TEST_ROLE", "decode")
BROKEN_PROMPT_LEN = 13


def break_decode() -> None:
    real = kv_source.ReferenceSource.decode

    def decode(self: kv_source.ReferenceSource, pool: Any, req: kv_source.DecodeRequest) -> Any:
        if req.prompt_len == BROKEN_PROMPT_LEN:
            raise RuntimeError("a model bug, on purpose")
        return real(self, pool, req)

    kv_source.ReferenceSource.decode = decode  # type: ignore[method-assign]


def corrupt_kv() -> None:
    real = kv_digest.page_digests
    which = int(os.environ.get("KVROOM_TEST_CORRUPT_PAGE", "0"))  # of the room's pages; -1: the last

    def page_digests(pool: Any, pages: list[int], offset: int, length: int, *kind: Any) -> list[int]:
        page_bytes = pool.data.view(pool.num_pages, -1).view(torch.uint8)
        page_bytes[pages[which], offset + length - 1] ^= 0x10  # one byte of what the prefill wrote there
        return real(pool, pages, offset, length, *kind)

    kv_digest.page_digests = page_digests


class _HeldEngine:
    """The real engine, whose first write starts only once ``release`` exists."""

    def __init__(self, engine: Any, release: Path):
        self._engine = engine
        self._release = release
        self._held: dict[int, dict[str, Any]] = {}
        self._first = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        if not self._first:
            return int(self._engine.transfer_submit_write(peer, src, dst, length))
        self._first = False
        fake = 1 << 60
        state: dict[str, Any] = {"real": None}
        self._held[fake] = state

        def later() -> None:
            while not self._release.exists():
                time.sleep(0.01)
            state["real"] = self._engine.transfer_submit_write(peer, src, dst, length)

        threading.Thread(target=later, daemon=True).start()
        return fake

    def transfer_check_status(self, batch_id: int) -> int:
        state = self._held.get(batch_id)
        if state is None:
            return int(self._engine.transfer_check_status(batch_id))
        if state["real"] is None:
            return 0  # still held: not started, not finished
        status = int(self._engine.transfer_check_status(state["real"]))
        if status in (1, -1):
            del self._held[batch_id]
        return status


def late_write() -> None:
    real_init = transfer.MooncakeEngine.__init__
    release = Path(os.environ["KVROOM_TEST_RELEASE_FILE"])

    def init(self: transfer.MooncakeEngine, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self._engine = _HeldEngine(self._engine, release)

    transfer.MooncakeEngine.__init__ = init  # type: ignore[method-assign]


HOOKS = {"break-decode": break_decode, "corrupt-kv": corrupt_kv, "late-write": late_write}


if __name__ == "__main__":
    HOOKS[HOOK]()
    if ROLE == "prefill":
        from prefill_node.__main__ import main
    else:
        from decode_node.__main__ import main
    main()
