"""One thread that runs every KV write of a prefill rank, and sends each done+aux.

Writes run one after another here: several at once would take the cores that
the engine's own threads, the receiving side and the event loops on the same
host need (a blocking engine call spins a core; over TCP the wait sleeps
between polls, but moving the bytes still costs CPU on both sides). Done+aux
leaves from this thread the moment the write returned, with no event loop
between "bytes landed" and "decode told".

A write that gave up while some of it may still move is quarantined: the
thread keeps asking the engine about it between tasks, and says when nothing
of it moves any more (``on_resolved``). Until then neither side may reuse the
pages it touches.
"""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from shared import kv_digest, protocol
from shared.errors import TransferError
from shared.kv_layout import Write
from shared.kv_pool import KVPool
from shared.security import Security
from shared.transfer import WRITE_TIMEOUT_S, TransferEngine, WriteUnresolved
from shared.zmq_io import PushSockets

log = logging.getLogger(__name__)

# How often quarantined writes are asked about while no task comes.
QUARANTINE_POLL_S = 0.05


@dataclasses.dataclass
class Digests:
    """Verify mode: digest these bytes of each source page before writing."""

    pool: KVPool
    pages: list[int]
    offset: int
    length: int


@dataclasses.dataclass
class TransferTask:
    room: int
    decode_rank: int
    peer: protocol.PeerRank
    writes: list[Write]
    done: protocol.KvDone  # completed_at, bytes_written and digests are filled in by the worker
    aux: bytes
    digests: Digests | None = None


@dataclasses.dataclass
class TransferOutcome:
    task: TransferTask
    written: int = 0
    seconds: float = 0.0
    started_at: float = 0.0  # wall clock, for the benchmark's stages
    done_at: float = 0.0
    error: str | None = None
    sent: bool = False  # done+aux queued to the decode
    cancelled: bool = False
    unresolved: bool = False  # some write may still move: quarantined until on_resolved


class TransferWorker:
    def __init__(
        self,
        engine: TransferEngine,
        security: Security,
        on_finished: Callable[[TransferOutcome], object],
        on_resolved: Callable[[int, int], object],
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ):
        """Both callbacks are called from the worker thread; hand them to the event loop yourself."""
        self._engine = engine
        self._on_finished = on_finished
        self._on_resolved = on_resolved
        self._write_timeout_s = write_timeout_s
        self._queue: queue.SimpleQueue[TransferTask | None] = queue.SimpleQueue()
        self._cancelled: set[int] = set()
        self._quarantine: dict[tuple[int, int], list[int]] = {}  # (room, decode rank) -> engine ids
        self._context = zmq.Context()
        self._push = PushSockets(self._context, security)
        self._thread = threading.Thread(target=self._run, name="kv-transfer", daemon=True)
        self._thread.start()

    def submit(self, task: TransferTask) -> None:
        self._queue.put(task)

    def cancel(self, room: int) -> None:
        """Skip the room's writes that have not started, and never send its done+aux."""
        self._cancelled.add(room)

    def forget(self, room: int) -> None:
        """The room's outcome was handled; drop its cancel mark."""
        self._cancelled.discard(room)

    @property
    def quarantined(self) -> int:
        return len(self._quarantine)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10)
        self._push.close()
        self._context.term()

    def _run(self) -> None:
        while True:
            try:
                task = self._queue.get(timeout=QUARANTINE_POLL_S if self._quarantine else None)
            except queue.Empty:
                self._poll_quarantine()
                continue
            if task is None:
                return
            self._on_finished(self._transfer(task))
            self._poll_quarantine()

    def _transfer(self, task: TransferTask) -> TransferOutcome:
        outcome = TransferOutcome(task)
        if task.room in self._cancelled:
            outcome.cancelled = True
            return outcome
        try:
            digests = None
            if task.digests is not None:
                d = task.digests
                digests = kv_digest.page_digests(d.pool, d.pages, d.offset, d.length)
            outcome.started_at, started = time.time(), time.perf_counter()
            outcome.written = self._engine.write(task.peer.session_id, task.writes, self._write_timeout_s)
            outcome.seconds = time.perf_counter() - started
            if task.room in self._cancelled:
                outcome.cancelled = True
                return outcome
            outcome.done_at = time.time()
            done = msgspec.structs.replace(
                task.done, bytes_written=outcome.written, completed_at=outcome.done_at, digests=digests
            )
            frames = protocol.encode(done, task.aux)
            outcome.sent = self._push.send(task.peer.zmq_endpoint, task.peer.public_key, frames)
        except WriteUnresolved as exc:
            outcome.error = str(exc)
            outcome.unresolved = True
            if exc.pending:  # else the engine gives no way to ask: the room's lease decides
                self._quarantine[(task.room, task.decode_rank)] = exc.pending
        except TransferError as exc:
            outcome.error = str(exc)
        except Exception as exc:  # never let one room end the worker
            log.exception("room=%d transfer worker failed", task.room, extra={"room": task.room})
            outcome.error = repr(exc)
        return outcome

    def _poll_quarantine(self) -> None:
        # Only this thread touches the quarantine.
        for key, pending in list(self._quarantine.items()):
            still = self._engine.unresolved(pending)
            if still:
                self._quarantine[key] = still
            else:
                del self._quarantine[key]
                self._on_resolved(*key)
