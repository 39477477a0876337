"""Stand-ins for unit tests of the logic above the transfer engine; they prove nothing about
real transfers."""

import ctypes
from collections.abc import Iterable

from shared.errors import TransferError
from shared.kv.layout import Write
from shared.kv.transfer import WRITE_TIMEOUT_S, TransferEngine
from shared.room.record import Room
from shared.room.states import RoomState
from shared.wire import protocol


class FakeEngine(TransferEngine):
    """In-process memmove between regions registered in one shared directory."""

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

    def write(self, peer_session: str, writes: Iterable[Write], timeout_s: float = WRITE_TIMEOUT_S) -> int:
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


class RecordingPeers:
    """A rank's port to its peers that records each message; with ``reachable`` False every send
    fails, as when a peer's queue is full."""

    def __init__(self) -> None:
        self.sent: list[protocol.Message] = []
        self.reachable = True

    def send(self, peer: protocol.PeerRank, msg: protocol.Message, aux: bytes | None = None) -> bool:
        if self.reachable:
            self.sent.append(msg)
        return self.reachable


class RecordingLink:
    """Rank 0's link to the bootstrap, recorded: the state of each report; the bootstrap is the
    sender without a key (security off)."""

    def __init__(self) -> None:
        self.reports: list[RoomState] = []

    def is_bootstrap(self, sender: str | None) -> bool:
        return sender is None

    def report(self, room: Room) -> None:
        self.reports.append(room.state)

    def tokens(self, room: protocol.TransferId, offset: int, tokens: list[int]) -> None:
        pass
