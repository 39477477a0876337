"""The transfer engine interface and its Mooncake implementation.

A fake for unit tests of the logic above the engine lives in ``tests/fakes.py``.
"""

import abc
import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field

from shared.errors import TransferError
from shared.kv.layout import Write, total_bytes
from shared.settings import Transport

log = logging.getLogger(__name__)

# One TCP batch of a few thousand entries fails or wedges the peer; stay far below.
MAX_BATCH_ENTRIES = 512
# Writes submitted and not yet completed, when they are waited on by polling; the engine
# queues at most 1024 per peer by default.
MAX_IN_FLIGHT = 256
# Between two looks at a polled write. The sleep lets the engine's threads, and the
# event loop waiting for the GIL, have the core.
POLL_INTERVAL_S = 20e-6
# A write gives up after this, plus a second per GB, like the engine's own blocking calls.
WRITE_TIMEOUT_S = 30.0


class WriteUnresolved(TransferError):
    """The write gave up while some of it may still be moving.

    ``pending`` holds the engine's ids of the writes whose end is not known;
    empty where the engine gives no way to ask (its blocking batch call). Until
    they resolve, the source pages may still be read and the destination pages
    written: neither side may reuse them.
    """

    def __init__(self, message: str, pending: list[int]):
        super().__init__(message)
        self.pending = pending


_TRANSPORT_VARIABLES = ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK", "MC_FORCE_MNNVL")
# What the engine's submit returns when it could not start a write (its ids are addresses).
_NO_BATCH = frozenset({0, -1, (1 << 64) - 1})


@dataclass(frozen=True)
class EngineSetup:
    """How to start the engine for a transport: its arguments and environment.

    The engine picks its transport at start-up from environment variables, and
    it tests some of them for presence, not value: a variable set to "0" still
    counts. So every transport variable is either set or removed explicitly.
    The protocol argument only chooses the memory allocator.
    """

    protocol: str
    device_name: str
    environment: dict[str, str]
    unset: tuple[str, ...]

    def apply(self, environ: MutableMapping[str, str]) -> None:
        for name in self.unset:
            environ.pop(name, None)
        environ.update(self.environment)


def engine_setup(transport: Transport, rdma_devices: str = "") -> EngineSetup:
    if transport == "tcp":
        env = {"MC_FORCE_TCP": "1"}
        return EngineSetup("tcp", "", env, tuple(v for v in _TRANSPORT_VARIABLES if v not in env))
    if transport == "rdma":
        # Named devices (mlx5_0,mlx5_1) or, when empty, every HCA the engine discovers.
        return EngineSetup("rdma", rdma_devices, {}, _TRANSPORT_VARIABLES)
    if transport == "nvlink":
        env = {"MC_INTRANODE_NVLINK": "1"}
        return EngineSetup("rdma", "", env, tuple(v for v in _TRANSPORT_VARIABLES if v not in env))
    raise ValueError(f"unknown transport {transport!r}")


def write_deadline(total_bytes: int, timeout_s: float) -> float:
    return time.monotonic() + timeout_s + total_bytes / 1e9


@dataclass(frozen=True)
class WriteJob:
    """The arguments of one ``TransferEngine.write``."""

    peer_session: str
    writes: Sequence[Write]
    timeout_s: float = WRITE_TIMEOUT_S


class TransferEngine(abc.ABC):
    """Moves bytes from local registered memory into a peer's registered memory."""

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """``host:port`` under which peers reach this engine."""

    @abc.abstractmethod
    def register(self, ptr: int, nbytes: int) -> None:
        """Make ``[ptr, ptr + nbytes)`` a source or destination of transfers.

        Raises TransferError if the engine refuses the region.
        """

    @abc.abstractmethod
    def write(self, peer_session: str, writes: Iterable[Write], timeout_s: float = WRITE_TIMEOUT_S) -> int:
        """Write every ``(src, dst, length)`` into the peer; blocks until all completed.

        Returns the bytes written. Raises TransferError if a write failed and
        none is still moving (the destination may hold a partial copy), and
        WriteUnresolved if it gave up after ``timeout_s`` (plus a second per
        GB) while some may still move. Must not run on an event loop.
        """

    @property
    def overlaps_writes(self) -> bool:
        """Whether ``write_together`` has several jobs' writes out at once (else it runs them in turn)."""
        return False

    def write_together(self, jobs: Sequence[WriteJob]) -> Iterator[int | TransferError]:
        """Several calls of ``write`` at once, where the engine can have them all out together.

        Yields, for each job in order, what its ``write`` would have returned,
        or the TransferError it would have raised. By default the jobs run one
        after another.
        """
        for job in jobs:
            try:
                yield self.write(job.peer_session, job.writes, job.timeout_s)
            except TransferError as exc:
                yield exc

    def unresolved(self, pending: list[int]) -> list[int]:
        """Of the writes a WriteUnresolved named, those still not finished; asking frees the rest."""
        return []

    def close(self) -> None:
        """Release the engine's resources; further calls are undefined."""


class MooncakeEngine(TransferEngine):
    def __init__(
        self,
        hostname: str,
        transport: Transport = "tcp",
        rdma_devices: str = "",
        advertise_host: str | None = None,
    ):
        setup = engine_setup(transport, rdma_devices)
        setup.apply(os.environ)
        try:
            from mooncake.engine import TransferEngine as _Engine
        except ImportError as exc:
            raise TransferError("the mooncake transfer engine is not installed") from exc
        self._engine = _Engine()
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", setup.protocol, setup.device_name)
        if rc != 0:
            raise TransferError(f"engine initialize({hostname}, {transport}) returned {rc}")
        self._session_id = f"{advertise_host or hostname}:{self._engine.get_rpc_port()}"
        # Over TCP the engine's own threads move the bytes, and its blocking calls spin a
        # core until they are done: on a small host the spinning slows the very threads
        # it waits for. RDMA and NVLink move bytes in hardware, where spinning notices
        # completion soonest.
        self._polled = transport == "tcp"
        # Blocking writes given up on at their deadline, whose threads were still in the engine.
        self.hung_writes = 0

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({ptr:#x}, {nbytes}) returned {rc}")

    def write(self, peer_session: str, writes: Iterable[Write], timeout_s: float = WRITE_TIMEOUT_S) -> int:
        if self._polled:
            return self.write_polled(peer_session, writes, timeout_s)
        return self.write_blocking(peer_session, writes, timeout_s)

    def write_blocking(
        self, peer_session: str, writes: Iterable[Write], timeout_s: float = WRITE_TIMEOUT_S
    ) -> int:
        """The engine's own blocking batch call, which spins until the batch completed, on a
        thread of its own that is waited for until the deadline.

        The engine's call has no deadline of its own (RDMA, NVLink): one that hangs is given up
        on, WriteUnresolved, and its thread is left to it instead of the caller, whose other
        writes go on. Its failure does not say whether it failed or gave up on writes still
        moving, and its ids cannot be asked after: a failure is unresolved too.
        """
        batch = list(writes)
        outcome: concurrent.futures.Future[int] = concurrent.futures.Future()
        given_up = threading.Event()  # once set, the thread starts no more of the batch

        def call() -> None:
            try:
                outcome.set_result(self._write_batches(peer_session, batch, given_up))
            except BaseException as exc:  # the caller gets whatever ended it
                outcome.set_exception(exc)

        threading.Thread(target=call, name="kvroom-blocking-write", daemon=True).start()
        deadline_s = timeout_s + total_bytes(batch) / 1e9
        try:
            return outcome.result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:
            given_up.set()
            self.hung_writes += 1
            log.error(
                "a write of %d entries to %s hung past %.1fs: left to its thread",
                len(batch),
                peer_session,
                deadline_s,
            )
            raise WriteUnresolved(
                f"write of {len(batch)} entries to {peer_session} still out after {deadline_s:.1f}s", []
            ) from None

    def _write_batches(self, peer_session: str, batch: list[Write], given_up: threading.Event) -> int:
        total = 0
        for start in range(0, len(batch), MAX_BATCH_ENTRIES):
            if given_up.is_set():
                raise WriteUnresolved(f"write to {peer_session} given up at its deadline", [])
            chunk = batch[start : start + MAX_BATCH_ENTRIES]
            src, dst, lengths = (list(col) for col in zip(*chunk, strict=True))
            if len(chunk) == 1:
                rc = self._engine.transfer_sync_write(peer_session, src[0], dst[0], lengths[0])
            else:
                rc = self._engine.batch_transfer_sync_write(peer_session, src, dst, lengths)
            if rc != 0:
                raise WriteUnresolved(f"write of {len(chunk)} entries to {peer_session} returned {rc}", [])
            total += sum(lengths)
        return total

    def write_polled(
        self, peer_session: str, writes: Iterable[Write], timeout_s: float = WRITE_TIMEOUT_S
    ) -> int:
        """Submit each write on its own and wait for them by polling, asleep in between.

        Writes go one per engine batch because the engine's non-blocking status
        call looks at the first entry of a batch only (and frees a batch once it
        reports it finished). A failure stops further submits, but what was
        submitted is waited for, so no write is still reading our pages when
        this returns, unless the deadline passed: then WriteUnresolved names
        the writes still out.
        """
        return self._settle(self._submit(WriteJob(peer_session, list(writes), timeout_s)))

    @property
    def overlaps_writes(self) -> bool:
        return self._polled

    def write_together(self, jobs: Sequence[WriteJob]) -> Iterator[int | TransferError]:
        """Over TCP, every job's writes are submitted before any is waited for.

        A small write costs far more than its bytes (a few hundred microseconds
        here for 64 KiB), and the engine's threads overlap those costs when
        several writes are out: eight rooms' writes together finished in a
        quarter of the time one after another. Each job is then waited for in
        order, as ``write_polled`` waits, so none is still reading our pages
        once its outcome is yielded, unless it is a WriteUnresolved.
        """
        if not self._polled or len(jobs) < 2 or sum(len(j.writes) for j in jobs) > MAX_IN_FLIGHT:
            yield from super().write_together(jobs)
            return
        for out in [self._submit(job) for job in jobs]:
            try:
                yield self._settle(out)
            except TransferError as exc:
                yield exc

    def _submit(self, job: WriteJob) -> "_Submitted":
        """Submit the job's writes, at most MAX_IN_FLIGHT out at once (past that, each waits for
        the oldest); a failure stops further submits."""
        out = _Submitted(job, write_deadline(total_bytes(job.writes), job.timeout_s))
        for src, dst, length in job.writes:
            if len(out.in_flight) == MAX_IN_FLIGHT:
                out.error = self._wait(out.in_flight[0], out.deadline)
                if out.error == "timed out":
                    break
                out.in_flight.popleft()
                if out.error is not None:
                    break
            batch_id = self._engine.transfer_submit_write(job.peer_session, src, dst, length)
            if batch_id in _NO_BATCH:
                out.error = "the engine refused the write"
                break
            out.in_flight.append(batch_id)
        return out

    def _settle(self, out: "_Submitted") -> int:
        """Wait for every write still out; the bytes written, or why not."""
        unresolved = []
        error = out.error
        for batch_id in out.in_flight:
            outcome = self._wait(batch_id, out.deadline)
            if outcome == "timed out":
                unresolved.append(batch_id)
            error = error or outcome
        if unresolved:
            raise WriteUnresolved(
                f"{len(unresolved)} of {len(out.job.writes)} writes to {out.job.peer_session}"
                " still out after the deadline",
                unresolved,
            )
        if error is not None:
            raise TransferError(f"write of {len(out.job.writes)} entries to {out.job.peer_session}: {error}")
        return total_bytes(out.job.writes)

    def _wait(self, batch_id: int, deadline: float) -> str | None:
        """None once the write completed, else why not."""
        while (status := self._engine.transfer_check_status(batch_id)) in (0, -2):
            if time.monotonic() > deadline:
                return "timed out"
            time.sleep(POLL_INTERVAL_S)
        return None if status == 1 else f"failed with status {status}"

    def unresolved(self, pending: list[int]) -> list[int]:
        # Completed (1) and failed (-1) are the statuses after which the engine frees the id.
        return [b for b in pending if self._engine.transfer_check_status(b) not in (1, -1)]


@dataclass
class _Submitted:
    """One job's writes once submitted: those still out, and the first failure."""

    job: WriteJob
    deadline: float
    in_flight: collections.deque[int] = field(default_factory=collections.deque)
    error: str | None = None
