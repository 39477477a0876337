"""The borrower's side of a lease: every transition of the table, and the ones it refuses."""

import itertools

import pytest

from shared.errors import IllegalTransition
from shared.kv.borrow import TRANSITIONS, Borrow, BorrowState

B = BorrowState

# Each legal transition, with the path that reaches its start from IDLE.
PATHS = {
    B.IDLE: [],
    B.WRITING: [B.WRITING],
    B.WRITTEN: [B.WRITING, B.WRITTEN],
    B.STOPPED: [B.WRITING, B.STOPPED],
    B.UNRESOLVED: [B.WRITING, B.UNRESOLVED],
    B.RELEASED: [B.RELEASED],
}
LEGAL = {
    (B.IDLE, B.WRITING),
    (B.IDLE, B.RELEASED),  # never written to: released at once
    (B.WRITING, B.WRITTEN),
    (B.WRITING, B.STOPPED),
    (B.WRITING, B.UNRESOLVED),
    (B.UNRESOLVED, B.STOPPED),  # the write that gave up ended, or its deadline passed
    (B.STOPPED, B.RELEASED),
    (B.WRITTEN, B.RELEASED),  # a revocation after done+aux went out
}


def at(state: BorrowState) -> Borrow:
    borrow = Borrow(transfer=7, decode_rank=1)
    for step in PATHS[state]:
        borrow.to(step)
    return borrow


def test_the_table_is_exactly_the_legal_transitions() -> None:
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL


@pytest.mark.parametrize(("start", "new"), list(itertools.product(BorrowState, BorrowState)))
def test_every_transition_is_taken_or_refused_by_the_table(start: BorrowState, new: BorrowState) -> None:
    borrow = at(start)
    if (start, new) in LEGAL:
        borrow.to(new)
        assert borrow.state is new
    else:
        with pytest.raises(IllegalTransition):
            borrow.to(new)
        assert borrow.state is start


def test_an_unresolved_write_holds_until_it_ends_or_its_deadline_passes() -> None:
    borrow = at(B.WRITING)
    borrow.gave_up(deadline=10.0)
    assert not borrow.may_release
    assert not borrow.expire_if_due(9.0) and borrow.state is B.UNRESOLVED
    assert borrow.expire_if_due(10.5) and borrow.state is B.STOPPED
    assert borrow.may_release and not borrow.expire_if_due(11.0)  # once only


@pytest.mark.parametrize("state", list(BorrowState))
def test_only_a_rank_nothing_can_still_move_into_may_be_released(state: BorrowState) -> None:
    assert at(state).may_release is (state in (B.IDLE, B.STOPPED))
