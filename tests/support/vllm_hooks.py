"""A KvroomConnector whose prefill ranks hold back or change their done+aux when a test says so.

The test drives it with files in the directory ``$KVROOM_TEST_HOOKS`` names: while ``hold``
exists, done+aux waits (and ``held-<transfer>`` says one is waiting); while ``tamper`` exists,
each record leaves with one bit flipped; while ``deaf`` exists, revokes are not heard (as if the
decode's messages no longer reached the prefill); while ``stall`` exists, a prefill server computes
no prompt (``stalled-<request>`` says which wait), as a busy one would not yet.
"""

import asyncio
import os
from pathlib import Path
from typing import Any

from kvroom_vllm.connector import KvroomConnector
from kvroom_vllm.worker import WorkerHalf
from shared.wire import protocol


class HookedWorker(WorkerHalf):
    def _on_revoke(self, msg: protocol.RevokeLease, sender: str | None) -> None:
        if not (Path(os.environ["KVROOM_TEST_HOOKS"]) / "deaf").exists():
            super()._on_revoke(msg, sender)

    def send_done_aux(self, peer: protocol.PeerRank, done: protocol.DoneAux, record: bytes) -> None:
        hooks = Path(os.environ["KVROOM_TEST_HOOKS"])
        if (hooks / "tamper").exists():
            record = bytes([record[0] ^ 1]) + record[1:]
        if (hooks / "hold").exists():
            (hooks / f"held-{done.transfer}").touch()
            asyncio.get_running_loop().create_task(self._send_when_let_go(hooks, peer, done, record))
            return
        super().send_done_aux(peer, done, record)

    async def _send_when_let_go(
        self, hooks: Path, peer: protocol.PeerRank, done: protocol.DoneAux, record: bytes
    ) -> None:
        while (hooks / "hold").exists():
            await asyncio.sleep(0.05)
        super().send_done_aux(peer, done, record)


class HookedKvroomConnector(KvroomConnector):
    worker_class = HookedWorker

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        hooks = Path(os.environ["KVROOM_TEST_HOOKS"])
        if self._kv_transfer_config.kv_role == "kv_producer" and (hooks / "stall").exists():
            (hooks / f"stalled-{request.request_id}").touch()
            return None, False  # vLLM leaves the request waiting, and asks again next step
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
