"""Pages lent to a peer rank for its writes: the one rule that keeps a late write out of pages
another room holds.

A decode rank lends a room's pages to each prefill rank that writes into them. While a lease is
open (LENT) a write of that rank may still land there, so the pages cannot be given to another
room, whatever became of the room. A lease closes once, by one of three transitions:

- RETURNED: the borrower said none of its writes can still move (its done, or its release);
- REVOKED: the borrower is gone (its node was lost): nothing more comes from it;
- EXPIRED: the lender asked for the pages back and no answer came by the lease's deadline.

The pool frees pages only when no open lease covers them (``KVPool.free``).
"""

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.errors import IllegalTransition


class LeaseState(enum.Enum):
    LENT = "lent"
    RETURNED = "returned"
    REVOKED = "revoked"
    EXPIRED = "expired"


# Every legal transition; a closed lease stays as it closed.
TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.LENT: frozenset({LeaseState.RETURNED, LeaseState.REVOKED, LeaseState.EXPIRED}),
    LeaseState.RETURNED: frozenset(),
    LeaseState.REVOKED: frozenset(),
    LeaseState.EXPIRED: frozenset(),
}


@dataclass
class Lease:
    transfer: int  # the placement attempt the pages were lent for
    peer_rank: int  # the borrower: a prefill rank
    pages: tuple[int, ...]
    on_close: Callable[["Lease"], None] = field(default=lambda lease: None, repr=False, compare=False)
    state: LeaseState = LeaseState.LENT
    deadline: float = float("inf")  # monotonic time it expires once the pages were asked back

    @property
    def open(self) -> bool:
        return self.state is LeaseState.LENT

    def _close(self, state: LeaseState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise IllegalTransition(self.transfer, f"lease {self.state.name}", state.name)
        self.state = state
        self.on_close(self)

    def ask_back(self, timeout_s: float, now: float | None = None) -> None:
        """The lender wants the pages back: the borrower must answer before the deadline."""
        if self.open:
            self.deadline = min(self.deadline, (time.monotonic() if now is None else now) + timeout_s)

    def returned(self) -> bool:
        """The borrower's writes are over; False if the lease had already closed (a late word)."""
        if not self.open:
            return False
        self._close(LeaseState.RETURNED)
        return True

    def revoke(self) -> None:
        """The borrower is gone."""
        if self.open:
            self._close(LeaseState.REVOKED)

    def expire_if_due(self, now: float) -> bool:
        if self.open and now > self.deadline:
            self._close(LeaseState.EXPIRED)
            return True
        return False
