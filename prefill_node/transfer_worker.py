"""One thread that runs every KV write of a prefill rank, and sends each done+aux.

One thread, not a pool: several threads waiting at once would take the cores
that the engine's own threads, the receiving side and the event loops on the
same host need (a blocking engine call spins a core). Where the engine can have
several rooms' writes out at once (over TCP), the rooms queued when the thread
takes its next task go to it together, up to ``TOGETHER_BYTES``: a small write
costs far more than its bytes, and the engine overlaps those costs. Done+aux
leaves from this thread the moment the room's writes completed, with no event
loop between "bytes landed" and "decode told".

A write that gave up while some of it may still move is quarantined: the
thread keeps asking the engine about it between tasks, and says when nothing
of it moves any more (``on_resolved``). Until then neither side may reuse the
pages it touches.
"""

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import zmq

from shared.errors import TransferError
from shared.kv.digest import Digester
from shared.kv.layout import Write, total_bytes
from shared.kv.transfer import MAX_IN_FLIGHT, WRITE_TIMEOUT_S, TransferEngine, WriteJob, WriteUnresolved
from shared.wire import protocol
from shared.wire.security import Security
from shared.wire.zmq_io import PushSockets

log = logging.getLogger(__name__)

# How often quarantined writes are asked about while no task comes.
QUARANTINE_POLL_S = 0.05
# Queued rooms go to the engine together while their bytes stay within this. Larger writes
# are bound by bandwidth: running them together would only delay the first room's done.
TOGETHER_BYTES = 2 << 20

Pending = concurrent.futures.Future[list[int]]


@dataclasses.dataclass
class Digests:
    """Verify mode: digest these bytes of each source page while the room's writes are out."""

    digester: Digester
    pages: list[int]
    offset: int
    length: int

    def start(self) -> "concurrent.futures.Future[list[int]]":
        return self.digester.start(self.pages, self.offset, self.length)


@dataclasses.dataclass
class TransferTask:
    transfer: protocol.TransferId
    decode_rank: int
    peer: protocol.PeerRank
    writes: list[Write]
    done: protocol.DoneAux  # completed_at, bytes_written and digests are filled in by the worker
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
        on_resolved: Callable[[protocol.TransferId, int], object],
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ):
        """Both callbacks are called from the worker thread; hand them to the event loop yourself."""
        self._engine = engine
        self._on_finished = on_finished
        self._on_resolved = on_resolved
        self._write_timeout_s = write_timeout_s
        self._queue: queue.SimpleQueue[TransferTask | None] = queue.SimpleQueue()
        self._cancelled: set[int] = set()
        self._quarantine: dict[
            tuple[protocol.TransferId, int], list[int]
        ] = {}  # (room, decode rank) -> engine ids
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
        held: TransferTask | None = None  # taken from the queue, but not room for it in the last batch
        while True:
            if held is not None:
                task: TransferTask | None = held
            else:
                try:
                    task = self._queue.get(timeout=QUARANTINE_POLL_S if self._quarantine else None)
                except queue.Empty:
                    self._poll_quarantine()
                    continue
            if task is None:
                return
            batch, held = self._batch(task)
            for outcome in self._transfer(batch):
                self._on_finished(outcome)
            self._poll_quarantine()

    def _batch(self, first: TransferTask) -> tuple[list[TransferTask], TransferTask | None]:
        """``first`` and the tasks queued behind it while they fit together (only ``first`` where
        the engine runs writes in turn); and the task taken that did not fit, for the next batch."""
        batch, nbytes, writes = [first], total_bytes(first.writes), len(first.writes)
        while self._engine.overlaps_writes and nbytes < TOGETHER_BYTES:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                return batch, None
            if task is None:
                self._queue.put(None)
                return batch, None
            nbytes, writes = nbytes + total_bytes(task.writes), writes + len(task.writes)
            if nbytes > TOGETHER_BYTES or writes > MAX_IN_FLIGHT:
                return batch, task
            batch.append(task)
        return batch, None

    def _transfer(self, tasks: list[TransferTask]) -> Iterator[TransferOutcome]:
        """Each task's outcome, in order, as soon as its writes ended."""
        live: list[tuple[TransferOutcome, Pending | None]] = []
        for task in tasks:
            outcome = TransferOutcome(task)
            if task.transfer in self._cancelled:
                outcome.cancelled = True
                yield outcome
                continue
            # The source pages do not change while they are written: their digests are
            # computed while the writes are out, and taken once they ended.
            try:
                live.append((outcome, task.digests.start() if task.digests is not None else None))
            except Exception as exc:  # never let one room end the worker
                log.exception(
                    "transfer=%d transfer worker failed", task.transfer, extra={"room": task.transfer}
                )
                outcome.error = repr(exc)
                yield outcome
        if not live:
            return
        jobs = [WriteJob(o.task.peer.session_id, o.task.writes, self._write_timeout_s) for o, _ in live]
        started_at, started = time.time(), time.perf_counter()
        broken = None  # the engine's binding itself failed: whatever it had out is unknown
        try:
            results = self._engine.write_together(jobs)
        except Exception as exc:
            broken = exc
        for outcome, digests in live:
            outcome.started_at = started_at
            if broken is None:
                try:
                    result = next(results)
                except Exception as exc:
                    broken = exc
            if broken is not None:
                # Its writes may still move, and the engine cannot be asked: the lease decides.
                room = outcome.task.transfer
                log.error("transfer=%d transfer engine failed: %r", room, broken, extra={"room": room})
                outcome.error, outcome.unresolved = repr(broken), True
            else:
                outcome.seconds = time.perf_counter() - started
                self._finish(outcome, result, digests)
            yield outcome

    def _finish(self, outcome: TransferOutcome, result: int | TransferError, digests: Pending | None) -> None:
        """Send done+aux for a task whose writes ended, or record why not."""
        task = outcome.task
        if isinstance(result, WriteUnresolved):
            outcome.error = str(result)
            outcome.unresolved = True
            if result.pending:  # else the engine gives no way to ask: the room's lease decides
                self._quarantine[(task.transfer, task.decode_rank)] = result.pending
            return
        if isinstance(result, TransferError):
            outcome.error = str(result)
            return
        outcome.written = result
        if task.transfer in self._cancelled:
            outcome.cancelled = True
            return
        try:
            outcome.done_at = time.time()
            done = msgspec.structs.replace(
                task.done,
                bytes_written=outcome.written,
                completed_at=outcome.done_at,
                digests=digests.result() if digests is not None else None,
            )
            frames = protocol.encode(done, task.aux)
            outcome.sent = self._push.send(task.peer.zmq_endpoint, task.peer.public_key, frames)
        except Exception as exc:  # never let one room end the worker
            log.exception("transfer=%d transfer worker failed", task.transfer, extra={"room": task.transfer})
            outcome.error = repr(exc)

    def _poll_quarantine(self) -> None:
        # Only this thread touches the quarantine.
        for key, pending in list(self._quarantine.items()):
            still = self._engine.unresolved(pending)
            if still:
                self._quarantine[key] = still
            else:
                del self._quarantine[key]
                self._on_resolved(*key)
