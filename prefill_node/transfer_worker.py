"""One thread that runs every KV write of a prefill node, and sends each room's done+aux.

Writes run one after another here: several at once would take the cores that
the engine's own threads, the receiving side and the event loops on the same
host need (a blocking engine call spins a core; over TCP the wait sleeps
between polls, but moving the bytes still costs CPU on both sides). Done+aux
leaves from this thread the moment the write returned, with no event loop
between "bytes landed" and "decode told".
"""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from shared import protocol
from shared.errors import TransferError
from shared.transfer import TransferEngine, Write
from shared.zmq_io import PushSockets

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TransferTask:
    room: int
    session_id: str
    writes: list[Write]
    endpoint: str
    done: protocol.KvDone  # completed_at and bytes_written are filled in after the write
    aux: bytes


@dataclasses.dataclass
class TransferOutcome:
    task: TransferTask
    written: int = 0
    seconds: float = 0.0
    error: str | None = None
    sent: bool = False  # done+aux queued to the decode


class TransferWorker:
    def __init__(self, engine: TransferEngine, on_finished: Callable[[TransferOutcome], object]):
        """``on_finished`` is called from the worker thread; hand it to the event loop yourself."""
        self._engine = engine
        self._on_finished = on_finished
        self._queue: queue.SimpleQueue[TransferTask | None] = queue.SimpleQueue()
        self._cancelled: set[int] = set()
        self._context = zmq.Context()
        self._push = PushSockets(self._context)
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def submit(self, task: TransferTask) -> None:
        self._queue.put(task)

    def cancel(self, room: int) -> None:
        """Skip the room's write if it has not started, and never send its done+aux."""
        self._cancelled.add(room)

    def forget(self, room: int) -> None:
        """The room's outcome was handled; drop its cancel mark."""
        self._cancelled.discard(room)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
        self._push.close()
        self._context.term()

    def _run(self) -> None:
        while (task := self._queue.get()) is not None:
            outcome = TransferOutcome(task)
            try:
                if task.room not in self._cancelled:
                    started = time.perf_counter()
                    outcome.written = self._engine.write(task.session_id, task.writes)
                    outcome.seconds = time.perf_counter() - started
                    if task.room not in self._cancelled:
                        done = msgspec.structs.replace(
                            task.done, bytes_written=outcome.written, completed_at=time.time()
                        )
                        outcome.sent = self._push.send(task.endpoint, protocol.encode(done, task.aux))
            except TransferError as exc:
                outcome.error = str(exc)
            except Exception as exc:  # never let one room end the worker
                log.exception("room=%d transfer worker failed", task.room, extra={"room": task.room})
                outcome.error = repr(exc)
            self._on_finished(outcome)
