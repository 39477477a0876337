"""What the kernel says about TCP connections a dead process wrote on: whether its bytes may
still land.

A process that exits leaves its sockets to the kernel, which goes on sending what they held and
closes them after it (a FIN). Its death alone does not say its writes are over, so the two ends
each look at their own kernel's table of connections (/proc/net/tcp): the sender's host holds no
closed connection whose bytes or FIN its peer has not acknowledged, and the receiving process
has read every byte that came before a peer's FIN. Together: nothing from the dead process is
still landing, and its peer may reuse the memory its writes went to.
"""

import asyncio
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# The kernel's state numbers (include/net/tcp_states.h).
FIN_WAIT1, CLOSE_WAIT, CLOSING = 0x04, 0x08, 0x0B
SOCKET_LINK = re.compile(r"^socket:\[(\d+)\]$")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Connection:
    local_port: int
    remote_port: int
    state: int
    tx_queue: int  # bytes sent but not acknowledged (or not sent yet)
    rx_queue: int  # bytes received but not read, and a received FIN until it is read
    inode: int  # 0 once no process holds the socket

    @property
    def orphan_still_sending(self) -> bool:
        """No process holds it, and its peer has not acknowledged all its bytes, or its FIN: what a
        dead process wrote that may still reach the peer."""
        return self.inode == 0 and (self.tx_queue > 0 or self.state in (FIN_WAIT1, CLOSING))

    @property
    def unread_after_close(self) -> bool:
        """Its peer closed it with bytes before the FIN still unread: bytes the reader has yet to
        copy into memory. (A kernel that counts an unread FIN in the queue only makes this wait
        for the reader to see the end, which the engine's reader does at once.)"""
        return self.state == CLOSE_WAIT and self.rx_queue > 0


def connections(tables: Iterable[str] = TABLES) -> Iterator[Connection]:
    for table in tables:
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:  # no IPv6, or no /proc: nothing to look at there
            continue
        for line in lines:
            fields = line.split()
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
            yield Connection(local, remote, int(fields[3], 16), tx, rx, int(fields[9]))


def own_socket_inodes() -> set[int]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            match = SOCKET_LINK.match(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
        if match:
            inodes.add(int(match.group(1)))
    return inodes


def dead_writes_sent() -> bool:
    """On the writer's host: every connection a dead process left has been acknowledged to its end."""
    return not any(c.orphan_still_sending for c in connections())


def closed_writes_read() -> bool:
    """In the receiving process: every byte its closed connections brought has been read."""
    own = own_socket_inodes()
    return not any(c.unread_after_close and c.inode in own for c in connections())


class AfterLanding(Generic[T]):
    """Things whose writers are gone (their process ended), handed to ``landed`` once nothing those
    writers sent can still land here: over TCP, once this process has read every connection a
    peer closed to its end, one look at the kernel every ``POLL_S`` serving all that wait; over
    RDMA or NVLink at once (the peer's end is the end of its writes). A thing that no longer
    ``waits`` (its fence ended meanwhile) is dropped, and with none left the looks stop."""

    POLL_S = 0.01

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        tcp: bool,
        waits: Callable[[T], bool],
        landed: Callable[[list[T]], None],
    ):
        self._loop = loop
        self._tcp = tcp
        self._waits = waits
        self._landed = landed
        self._waiting: list[T] = []

    def add(self, item: T) -> None:
        self._waiting.append(item)
        if len(self._waiting) == 1:  # else a look is already due
            self._look()

    def _look(self) -> None:
        self._waiting = [item for item in self._waiting if self._waits(item)]
        if not self._waiting:
            return
        if self._tcp and not closed_writes_read():
            self._loop.call_later(self.POLL_S, self._look)
            return
        landed, self._waiting = self._waiting, []
        self._landed(landed)
