"""The borrower's side of a lease: what a prefill rank's writes into one decode rank's pages may
still do, in one transition table.

- WRITING: the writes are with the transfer worker;
- WRITTEN: every write completed and done+aux went out (done+aux returns the lease);
- STOPPED: the writes failed or were cancelled, and none of them can still move;
- UNRESOLVED: the engine gave up on a write that may still move: until it ends, or the lease's
  deadline passes, the prefill neither frees the pages it reads nor tells the decode its pages
  are free;
- RELEASED: the decode rank was told (RoomReleased) nothing more will be written: its lease is
  returned.

A decode rank never written to is released straight away; one written to is released after a
revocation, so that the decode can stop fencing its pages.
"""

import enum
from dataclasses import dataclass

from shared.errors import IllegalTransition


class BorrowState(enum.Enum):
    IDLE = "idle"
    WRITING = "writing"
    WRITTEN = "written"
    STOPPED = "stopped"
    UNRESOLVED = "unresolved"
    RELEASED = "released"


B = BorrowState
TRANSITIONS: dict[BorrowState, frozenset[BorrowState]] = {
    B.IDLE: frozenset({B.WRITING, B.RELEASED}),
    B.WRITING: frozenset({B.WRITTEN, B.STOPPED, B.UNRESOLVED}),
    B.UNRESOLVED: frozenset({B.STOPPED}),
    B.STOPPED: frozenset({B.RELEASED}),
    B.WRITTEN: frozenset({B.RELEASED}),
    B.RELEASED: frozenset(),
}


@dataclass
class Borrow:
    transfer: int
    decode_rank: int
    state: BorrowState = B.IDLE
    deadline: float = float("inf")  # monotonic time an unresolved write is given up on

    def to(self, new: BorrowState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.transfer, f"borrow {self.state.name}", new.name)
        self.state = new

    def gave_up(self, deadline: float) -> None:
        """The engine gave up on a write that may still move, until ``deadline`` at the latest."""
        self.to(B.UNRESOLVED)
        self.deadline = deadline

    def expire_if_due(self, now: float) -> bool:
        """An unresolved write past its deadline is taken as over; True if this call ended it."""
        if self.state is B.UNRESOLVED and self.deadline < now:
            self.to(B.STOPPED)
            return True
        return False

    @property
    def may_release(self) -> bool:
        """Whether the decode rank may be told now that nothing more will be written."""
        return self.state in (B.IDLE, B.STOPPED)
