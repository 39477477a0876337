import itertools

import pytest

from shared.errors import IllegalTransition
from shared.room.states import TRANSITIONS, RoomState, check_transition, failed, forward_path, public_state

S = RoomState
LEGAL = {
    (S.BOOTSTRAPPING, S.WAITING_FOR_INPUT),
    (S.BOOTSTRAPPING, S.FAILED),
    (S.WAITING_FOR_INPUT, S.TRANSFERRING),
    (S.WAITING_FOR_INPUT, S.FAILED),
    (S.TRANSFERRING, S.SUCCESS),
    (S.TRANSFERRING, S.FAILED),
}


def test_order_matches_the_poll_enum():
    assert [int(s) for s in (S.FAILED, S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS)] == [
        0,
        1,
        2,
        3,
        4,
    ]


@pytest.mark.parametrize(("current", "new"), list(itertools.product(S, S)))
def test_every_pair(current, new):
    if (current, new) in LEGAL:
        assert check_transition(7, current, new) is new
    else:
        with pytest.raises(IllegalTransition) as info:
            check_transition(7, current, new)
        assert info.value.room == 7


def test_table_is_exactly_the_legal_set():
    assert {(a, b) for a, targets in TRANSITIONS.items() for b in targets} == LEGAL


def test_terminal_states_absorb():
    assert S.SUCCESS.terminal and S.FAILED.terminal
    assert not TRANSITIONS[S.SUCCESS] and not TRANSITIONS[S.FAILED]


def test_forward_path_walks_the_table():
    assert forward_path(S.BOOTSTRAPPING, S.SUCCESS) == [S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]
    assert forward_path(S.WAITING_FOR_INPUT, S.TRANSFERRING) == [S.TRANSFERRING]
    assert forward_path(S.TRANSFERRING, S.WAITING_FOR_INPUT) == []
    assert forward_path(S.TRANSFERRING, S.TRANSFERRING) == []
    assert forward_path(S.SUCCESS, S.SUCCESS) == []
    assert forward_path(S.FAILED, S.SUCCESS) == []
    assert forward_path(S.BOOTSTRAPPING, S.FAILED) == []
    for current, target in itertools.product(S, S):
        state = current
        for step in forward_path(current, target):
            state = check_transition(1, state, step)


@pytest.mark.parametrize(
    ("state", "outcome", "public", "is_failed"),
    [
        (RoomState.TRANSFERRING, None, "TRANSFERRING", False),
        (RoomState.SUCCESS, None, "SUCCESS", False),
        (RoomState.SUCCESS, "completed", "SUCCESS", False),
        (RoomState.SUCCESS, "failed", "FAILED", True),  # the decode failed after the transfer
        (RoomState.FAILED, None, "FAILED", True),
        (int(RoomState.FAILED), None, "FAILED", True),  # as the bootstrap's record holds it
    ],
)
def test_one_rule_says_whether_a_room_failed(state, outcome, public, is_failed):
    assert public_state(state, outcome) == public
    assert failed(state, outcome) is is_failed
