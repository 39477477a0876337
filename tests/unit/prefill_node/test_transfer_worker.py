"""The transfer thread: which rooms go to the engine together, and done+aux once each room's
writes ended. The engine is a stand-in that records its batches (no bytes move); done+aux
goes over a real ZMQ socket."""

import queue
import threading
from collections.abc import Iterator, Sequence

import pytest
import zmq

from prefill_node.transfer_worker import TOGETHER_BYTES, TransferOutcome, TransferTask, TransferWorker
from shared.errors import TransferError
from shared.kv.layout import total_bytes
from shared.kv.transfer import MAX_IN_FLIGHT, TransferEngine, WriteJob, WriteUnresolved
from shared.wire import protocol
from shared.wire.security import Security
from shared.wire.zmq_io import bind_pull
from tests.support import until

PLAIN = Security(None)


class BatchingEngine(TransferEngine):
    """Records each ``write_together`` call; the first waits until ``release`` is set, so that
    tasks queue up behind it. A job whose first write's source is in ``failing`` fails, and one in
    ``stuck`` is left unresolved."""

    def __init__(self, overlaps: bool = True) -> None:
        self.overlaps = overlaps
        self.batches: list[list[int]] = []  # the source address of each job's first write
        self.release = threading.Event()
        self.failing: set[int] = set()
        self.stuck: set[int] = set()

    @property
    def session_id(self) -> str:
        return "engine"

    def register(self, ptr: int, nbytes: int) -> None:
        pass

    @property
    def overlaps_writes(self) -> bool:
        return self.overlaps

    def write(self, peer_session, writes, timeout_s=0.0) -> int:
        raise AssertionError("the worker hands its writes over with write_together")

    def write_together(self, jobs: Sequence[WriteJob]) -> Iterator[int | TransferError]:
        self.batches.append([job.writes[0][0] for job in jobs])
        assert self.release.wait(10)
        for job in jobs:
            first = job.writes[0][0]
            if first in self.failing:
                yield TransferError(f"job {first} failed")
            elif first in self.stuck:
                yield WriteUnresolved(f"job {first} still out", [first])
            else:
                yield total_bytes(job.writes)

    def unresolved(self, pending: list[int]) -> list[int]:
        return pending


@pytest.fixture
def decode() -> Iterator[tuple[zmq.Socket, str]]:
    context = zmq.Context()
    pull = bind_pull(context, "tcp://127.0.0.1:*", PLAIN)
    yield pull, pull.getsockopt_string(zmq.LAST_ENDPOINT)
    pull.close(0)
    context.term()


@pytest.fixture
def worker() -> Iterator[tuple[TransferWorker, BatchingEngine, "queue.Queue[TransferOutcome]"]]:
    engine = BatchingEngine()
    finished: queue.Queue[TransferOutcome] = queue.Queue()
    w = TransferWorker(engine, PLAIN, finished.put, lambda room, rank: None)
    yield w, engine, finished
    engine.release.set()
    w.close()


def task(room: int, endpoint: str, nbytes: int = 64 << 10, writes: int = 1) -> TransferTask:
    peer = protocol.PeerRank(0, "decode:1", endpoint, "", 0, 1)
    size = nbytes // writes
    done = protocol.DoneAux(room, 0, 0, 0, writes, 0, 0.0)
    return TransferTask(room, 0, peer, [(room, i * size, size) for i in range(writes)], done, b"")


def outcomes(finished: "queue.Queue[TransferOutcome]", count: int) -> list[TransferOutcome]:
    return [finished.get(timeout=10) for _ in range(count)]


def first_write_out(engine: BatchingEngine) -> None:
    """Until the worker handed its first write to the engine: the next rooms queue behind it."""
    until(lambda: engine.batches, 10, "the worker to call the engine")


def test_rooms_queued_behind_a_write_go_to_the_engine_together(worker, decode):
    w, engine, finished = worker
    pull, endpoint = decode
    w.submit(task(1, endpoint))
    first_write_out(engine)
    for room in (2, 3, 4):
        w.submit(task(room, endpoint))
    engine.release.set()
    got = outcomes(finished, 4)
    assert engine.batches == [[1], [2, 3, 4]]
    assert [o.task.transfer for o in got] == [1, 2, 3, 4]
    assert all(o.sent and o.written == 64 << 10 and o.error is None for o in got)
    received = []
    for _ in range(4):
        assert pull.poll(10_000)
        msg, _ = protocol.decode(pull.recv_multipart())
        assert isinstance(msg, protocol.DoneAux)
        received.append((msg.transfer, msg.bytes_written))
    assert received == [(room, 64 << 10) for room in (1, 2, 3, 4)]


def test_a_batch_stays_within_its_bytes_and_the_engines_window(worker, decode):
    w, engine, finished = worker
    _, endpoint = decode
    w.submit(task(1, endpoint))
    first_write_out(engine)
    third = TOGETHER_BYTES // 3
    w.submit(task(2, endpoint, third))
    w.submit(task(3, endpoint, third))
    w.submit(task(4, endpoint, TOGETHER_BYTES // 2))  # would pass the bytes: waits for the next batch
    w.submit(task(5, endpoint, 4096, writes=1))
    w.submit(task(6, endpoint, 16 * MAX_IN_FLIGHT, writes=MAX_IN_FLIGHT))  # too many writes with 5
    engine.release.set()
    outcomes(finished, 6)
    assert engine.batches == [[1], [2, 3], [4, 5], [6]]


def test_each_room_of_a_batch_ends_on_its_own(worker, decode):
    w, engine, finished = worker
    pull, endpoint = decode
    engine.failing.add(2)
    engine.stuck.add(3)
    w.submit(task(1, endpoint))
    first_write_out(engine)
    for room in (2, 3, 4, 5):
        w.submit(task(room, endpoint))
    w.cancel(5)
    engine.release.set()
    got = {o.task.transfer: o for o in outcomes(finished, 5)}
    assert engine.batches == [[1], [2, 3, 4]]  # the cancelled room's writes never went out
    assert got[2].error == "job 2 failed" and not got[2].sent and not got[2].unresolved
    assert got[3].unresolved and not got[3].sent and w.quarantined == 1
    assert got[4].sent and got[1].sent
    assert got[5].cancelled and not got[5].sent
    rooms = set()
    while pull.poll(200):
        msg, _ = protocol.decode(pull.recv_multipart())
        rooms.add(msg.transfer)
    assert rooms == {1, 4}  # done+aux only for the rooms whose writes all landed


def test_a_fault_in_the_engines_binding_leaves_the_rest_of_the_batch_unresolved(worker, decode):
    """What the engine had out when its binding raised is unknown: those rooms' pages stay fenced
    (unresolved, no done+aux), and the worker goes on."""
    w, engine, finished = worker
    _, endpoint = decode

    def broken(jobs):
        engine.batches.append([job.writes[0][0] for job in jobs])
        assert engine.release.wait(10)
        yield jobs[0].writes[0][2]
        if len(jobs) > 1:
            raise RuntimeError("binding fault")

    engine.write_together = broken  # type: ignore[method-assign]
    w.submit(task(1, endpoint))
    first_write_out(engine)
    for room in (2, 3, 4):
        w.submit(task(room, endpoint))
    engine.release.set()
    got = {o.task.transfer: o for o in outcomes(finished, 4)}
    assert got[2].sent
    for room in (3, 4):
        assert got[room].unresolved and not got[room].sent
        assert got[room].error == "RuntimeError('binding fault')"

    def refused(jobs):
        raise RuntimeError("no engine")

    engine.write_together = refused  # type: ignore[method-assign]
    w.submit(task(5, endpoint))
    outcome = outcomes(finished, 1)[0]
    assert outcome.unresolved and not outcome.sent
    engine.write_together = BatchingEngine.write_together.__get__(engine)  # type: ignore[method-assign]
    w.submit(task(6, endpoint))
    assert outcomes(finished, 1)[0].sent


def test_an_engine_that_writes_in_turn_gets_one_room_at_a_time(decode):
    """Where writes run one after another anyway (RDMA, NVLink), rooms are not held back to batch."""
    _, endpoint = decode
    engine = BatchingEngine(overlaps=False)
    finished: queue.Queue[TransferOutcome] = queue.Queue()
    w = TransferWorker(engine, PLAIN, finished.put, lambda room, rank: None)
    try:
        w.submit(task(1, endpoint))
        first_write_out(engine)
        for room in (2, 3):
            w.submit(task(room, endpoint))
        engine.release.set()
        got = outcomes(finished, 3)
        assert engine.batches == [[1], [2], [3]]
        assert all(o.sent for o in got)
    finally:
        engine.release.set()
        w.close()
