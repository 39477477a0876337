"""The transfer engine interface, its Mooncake implementation and a fake for unit tests."""

import abc
import collections
import ctypes
import logging
import os
import time
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from typing import Literal

from shared.errors import TransferError

log = logging.getLogger(__name__)

Transport = Literal["tcp", "rdma", "nvlink"]
# One TCP batch of a few thousand entries fails or wedges the peer; stay far below.
MAX_BATCH_ENTRIES = 512
# Longer runs are cut: over TCP, pieces of this size moved faster than whole runs of
# 8 MiB and more, as the engine works on several pieces at once.
MAX_WRITE_BYTES = 4 << 20
# Writes submitted and not yet completed, when they are waited on by polling; the engine
# queues at most 1024 per peer by default.
MAX_IN_FLIGHT = 256
# Between two looks at a polled write. The sleep lets the engine's threads, and the
# event loop waiting for the GIL, have the core.
POLL_INTERVAL_S = 20e-6
# A write gives up after this, plus a second per GB, like the engine's own blocking calls.
WRITE_TIMEOUT_S = 30.0

Write = tuple[int, int, int]  # (source address, destination address, length)


def coalesce(
    src_base: int,
    src_pages: list[int],
    dst_base: int,
    dst_pages: list[int],
    page_bytes: int,
    max_bytes: int = MAX_WRITE_BYTES,
) -> list[Write]:
    """One write per run of pages that is consecutive on both sides, cut into pieces of ``max_bytes``."""
    if len(src_pages) != len(dst_pages):
        raise ValueError("source and destination page lists differ in length")
    writes: list[Write] = []
    run_start = 0
    for i in range(1, len(src_pages) + 1):
        if (
            i == len(src_pages)
            or src_pages[i] != src_pages[i - 1] + 1
            or dst_pages[i] != dst_pages[i - 1] + 1
        ):
            src = src_base + src_pages[run_start] * page_bytes
            dst = dst_base + dst_pages[run_start] * page_bytes
            length = (i - run_start) * page_bytes
            writes += [
                (src + at, dst + at, min(max_bytes, length - at)) for at in range(0, length, max_bytes)
            ]
            run_start = i
    return writes


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
    def write(self, peer_session: str, writes: Iterable[Write]) -> int:
        """Write every ``(src, dst, length)`` into the peer; blocks until all completed.

        Returns the bytes written. Raises TransferError if any write failed; the
        destination may then hold a partial copy. Must not run on an event loop.
        """

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

    @property
    def session_id(self) -> str:
        return self._session_id

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise TransferError(f"register_memory({ptr:#x}, {nbytes}) returned {rc}")

    def write(self, peer_session: str, writes: Iterable[Write]) -> int:
        if self._polled:
            return self.write_polled(peer_session, writes)
        return self.write_blocking(peer_session, writes)

    def write_blocking(self, peer_session: str, writes: Iterable[Write]) -> int:
        """The engine's own blocking batch call, which spins until the batch completed."""
        batch = list(writes)
        total = 0
        for start in range(0, len(batch), MAX_BATCH_ENTRIES):
            chunk = batch[start : start + MAX_BATCH_ENTRIES]
            src, dst, lengths = (list(col) for col in zip(*chunk, strict=True))
            if len(chunk) == 1:
                rc = self._engine.transfer_sync_write(peer_session, src[0], dst[0], lengths[0])
            else:
                rc = self._engine.batch_transfer_sync_write(peer_session, src, dst, lengths)
            if rc != 0:
                raise TransferError(f"write of {len(chunk)} entries to {peer_session} returned {rc}")
            total += sum(lengths)
        return total

    def write_polled(self, peer_session: str, writes: Iterable[Write]) -> int:
        """Submit each write on its own and wait for them by polling, asleep in between.

        Writes go one per engine batch because the engine's non-blocking status
        call looks at the first entry of a batch only. A failure stops further
        submits, but what was submitted is waited for, so no write is still
        reading our pages when this returns (unless it timed out, as the
        engine's blocking calls also give up).
        """
        batch = list(writes)
        total = sum(length for _, _, length in batch)
        deadline = time.monotonic() + WRITE_TIMEOUT_S + total / 1e9
        in_flight: collections.deque[int] = collections.deque()
        error = None
        for src, dst, length in batch:
            if len(in_flight) == MAX_IN_FLIGHT:
                error = self._wait(in_flight.popleft(), deadline)
                if error is not None:
                    break
            batch_id = self._engine.transfer_submit_write(peer_session, src, dst, length)
            if batch_id in _NO_BATCH:
                error = "the engine refused the write"
                break
            in_flight.append(batch_id)
        for batch_id in in_flight:
            error = self._wait(batch_id, deadline) or error
        if error is not None:
            raise TransferError(f"write of {len(batch)} entries to {peer_session}: {error}")
        return total

    def _wait(self, batch_id: int, deadline: float) -> str | None:
        """None once the write completed, else why not."""
        while (status := self._engine.transfer_check_status(batch_id)) == 0:
            if time.monotonic() > deadline:
                return "timed out"
            time.sleep(POLL_INTERVAL_S)
        return None if status == 1 else f"failed with status {status}"


class FakeEngine(TransferEngine):
    """In-process memmove between regions registered in one shared directory.

    For unit tests of the logic above the engine only; it proves nothing about
    real transfers.
    """

    def __init__(self, name: str, directory: dict[str, list[tuple[int, int]]]):
        self._name = name
        self._directory = directory
        directory.setdefault(name, [])
        self.writes: list[Write] = []

    @property
    def session_id(self) -> str:
        return self._name

    def register(self, ptr: int, nbytes: int) -> None:
        self._directory[self._name].append((ptr, nbytes))

    def write(self, peer_session: str, writes: Iterable[Write]) -> int:
        regions = self._directory.get(peer_session)
        if regions is None:
            raise TransferError(f"unknown peer {peer_session}")
        total = 0
        for src, dst, length in writes:
            if not any(base <= dst and dst + length <= base + size for base, size in regions):
                raise TransferError(f"{dst:#x}+{length} outside the peer's registered memory")
            ctypes.memmove(dst, src, length)
            self.writes.append((src, dst, length))
            total += length
        return total
