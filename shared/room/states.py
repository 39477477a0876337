"""Room states, failure reasons and the one transition table."""

import enum
import logging

from shared.errors import IllegalTransition

log = logging.getLogger(__name__)


class RoomState(enum.IntEnum):
    """Ordered so that the state all ranks agree on is the minimum over ranks."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in (RoomState.FAILED, RoomState.SUCCESS)


class FailureReason(enum.StrEnum):
    ABORTED = "aborted"
    PEER_LOST = "peer_lost"
    BOOTSTRAP_TIMEOUT = "bootstrap_timeout"
    WAITING_TIMEOUT = "waiting_timeout"
    TRANSFER_TIMEOUT = "transfer_timeout"
    AUX_TIMEOUT = "aux_timeout"
    AUX_INVALID = "aux_invalid"
    TRANSFER_FAILED = "transfer_failed"
    NO_CAPACITY = "no_capacity"
    PREFILL_FAILED = "prefill_failed"
    DECODE_FAILED = "decode_failed"
    AUX_MISMATCH = "aux_mismatch"
    KV_CORRUPT = "kv_corrupt"
    SHUTDOWN = "shutdown"
    DRAINING = "draining"  # a draining node refused a new room: it is placed elsewhere
    DEADLINE = "deadline"
    ORPHANED = "orphaned"


S = RoomState
TRANSITIONS: dict[RoomState, frozenset[RoomState]] = {
    S.BOOTSTRAPPING: frozenset({S.WAITING_FOR_INPUT, S.FAILED}),
    S.WAITING_FOR_INPUT: frozenset({S.TRANSFERRING, S.FAILED}),
    S.TRANSFERRING: frozenset({S.SUCCESS, S.FAILED}),
    S.SUCCESS: frozenset(),
    S.FAILED: frozenset(),
}


def check_transition(room: int, current: RoomState, new: RoomState) -> RoomState:
    """Return ``new`` if the table allows ``current -> new``, else raise IllegalTransition."""
    if new not in TRANSITIONS[current]:
        log.warning("room=%d illegal transition %s -> %s", room, current.name, new.name)
        raise IllegalTransition(room, current, new)
    return new


_FORWARD = [S.BOOTSTRAPPING, S.WAITING_FOR_INPUT, S.TRANSFERRING, S.SUCCESS]


def forward_path(current: RoomState, target: RoomState) -> list[RoomState]:
    """The states to pass through, in order, to move a live room forward to ``target``.

    Empty if ``target`` is not ahead of ``current``. Walking the path keeps every
    step legal and gives each state its timestamp even when notices were coalesced.
    """
    if current.terminal or target is S.FAILED or target <= current:
        return []
    return _FORWARD[_FORWARD.index(current) + 1 : _FORWARD.index(target) + 1]


def failed(state: RoomState | int, outcome: str | None) -> bool:
    """The one rule for a failed room: its transfer failed, or its request failed after the transfer
    succeeded (the decode raised, its node was lost mid-decode)."""
    return state == S.FAILED or outcome == "failed"


def public_state(state: RoomState | int, outcome: str | None) -> str:
    """A room's state as clients see it: the transfer state, FAILED once the room failed."""
    return "FAILED" if failed(state, outcome) else RoomState(state).name
