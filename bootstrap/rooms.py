"""A room as the bootstrap sees it: its moves, the reports folded into it, and how it reads.

These functions change a ``RoomData`` in place and do no I/O; the cluster runs
them inside the store's atomic updates. A room's ``state`` is its current
attempt's transfer state, SUCCESS once the decode node validated the KV and
aux; ``outcome`` is the request's end after that.
"""

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from bootstrap.store import Attempt, RoomData
from shared.room.states import FailureReason, RoomState, check_transition, forward_path
from shared.wire import protocol

log = logging.getLogger(__name__)

# Failures before SUCCESS that say nothing about the request itself: another
# placement may well serve it.
REPLACEABLE = frozenset(
    {
        FailureReason.PEER_LOST,
        FailureReason.NO_CAPACITY,
        FailureReason.BOOTSTRAP_TIMEOUT,
        FailureReason.WAITING_TIMEOUT,
        FailureReason.TRANSFER_TIMEOUT,
        FailureReason.TRANSFER_FAILED,
        FailureReason.SHUTDOWN,
        FailureReason.DRAINING,
    }
)


def new_id() -> int:
    """Non-zero and exact in a float64: 0 is never a room, and JSON tools keep every digit."""
    return secrets.randbelow(protocol.MAX_ROOM_ID) + 1


def unheard(room: RoomData, now: float, after_s: float) -> bool:
    """Whether the room's assignments went out over ``after_s`` ago and no node has reported on it
    since: they may never have left a bootstrap that was killed."""
    attempt = room.attempt
    placed = 0 < attempt.placed_at < now - after_s
    return placed and not room.done and room.state == RoomState.BOOTSTRAPPING and not attempt.node_states


def advance(room: RoomData, state: RoomState, ts: float | None = None) -> None:
    """Move the room's current attempt to ``state`` if the table allows it; IllegalTransition otherwise."""
    room.state = check_transition(room.room, RoomState(room.state), state)
    room.attempt.state = room.state
    room.timestamps[state.name] = ts or time.time()
    log.info("room=%d %s", room.room, state.name, extra={"room": room.room})


def end(room: RoomData, reason: str) -> bool:
    """End the room: FAILED, or its outcome failed once the transfer succeeded. True if this ended it."""
    if room.done:
        return False
    if room.state == RoomState.SUCCESS:
        room.outcome = "failed"
    else:
        advance(room, RoomState.FAILED)
        room.attempt.reason = reason
    room.reason = reason
    room.done = True
    log.info("room=%d ended reason=%s", room.room, reason, extra={"room": room.room})
    return True


def fail_attempt(room: RoomData, reason: str) -> None:
    """The current attempt failed before SUCCESS; the room waits for another placement."""
    advance(room, RoomState.FAILED)
    room.attempt.reason = reason
    log.info(
        "room=%d attempt %d failed reason=%s",
        room.room,
        len(room.attempts),
        reason,
        extra={"room": room.room},
    )


def replaceable(room: RoomData, reason: str, max_attempts: int) -> bool:
    return room.state != RoomState.SUCCESS and reason in REPLACEABLE and len(room.attempts) < max_attempts


def add_attempt(room: RoomData, attempt: Attempt) -> None:
    """A new attempt: the room starts again from BOOTSTRAPPING, on nodes to be chosen."""
    room.attempts.append(attempt)
    room.state = RoomState.BOOTSTRAPPING
    room.timestamps = {RoomState.BOOTSTRAPPING.name: time.time()}


def attempt_of(room: RoomData, transfer: protocol.TransferId) -> int:
    return next(i for i, a in enumerate(room.attempts) if a.transfer == transfer)


def apply(room: RoomData, index: int, role: str, report: protocol.RoomStatus) -> str | None:
    """Fold a node's report on attempt ``index`` into the room.

    Returns the reason the current attempt failed, if this report says so and
    the room has not ended: the caller decides between another placement and
    the end. Only the decode node's report moves the room forward: SUCCESS is
    what it validated.
    """
    attempt = room.attempts[index]
    state = RoomState(report.state)
    attempt.node_states[role] = {
        "state": state.name,
        "reason": report.reason,
        "outcome": report.outcome,
        "ts": report.timestamps.get(state.name),
    }
    if index != len(room.attempts) - 1:
        return None
    room.timings.update(report.timings)  # the prefill's come once the room may have ended
    if room.done:
        return None
    if state is RoomState.FAILED:
        if room.state == RoomState.SUCCESS or room.state == RoomState.FAILED:
            return None
        return report.reason or f"{role}_failed"
    if role != "decode":
        return None
    for step in forward_path(RoomState(room.state), state):
        advance(room, step, report.timestamps.get(step.name))
    if room.state == RoomState.SUCCESS and report.outcome is not None:
        if report.outcome == "completed":
            complete(room, report.output_ids or [], report.finish_reason)
        else:
            end(room, report.reason or FailureReason.DECODE_FAILED)
    return None


def complete(room: RoomData, output_ids: list[int], finish_reason: str | None) -> None:
    """The request ended well, after its transfer's SUCCESS: the room ends with its output."""
    assert room.state == RoomState.SUCCESS and not room.done
    room.output_ids = output_ids
    room.finish_reason = finish_reason
    room.outcome = "completed"
    room.done = True


def view(
    room: RoomData,
    detokenize: Callable[[list[int]], str],
    sessions: Callable[[str], list[str]],
    streamed: list[int] | None = None,
) -> dict[str, Any]:
    """The room as GET /rooms/{room} shows it; ``sessions`` gives a node's ranks' session ids."""
    output = room.output_ids
    if output is None and room.partial and streamed:
        output = streamed
    attempt = room.attempt
    return {
        "room": room.room,
        "state": room.public_state,
        "transfer_state": RoomState(room.state).name,
        "outcome": room.outcome,
        "reason": room.reason,
        "finish_reason": room.finish_reason,
        "finished": room.done,
        "partial": room.partial,
        "prompt_tokens": len(room.input_ids),
        "max_new_tokens": room.max_new_tokens,
        "output_ids": output,
        "text": detokenize(output) if output is not None else None,
        "prefill": {"node_id": attempt.prefill, "session_ids": sessions(attempt.prefill)},
        "decode": {"node_id": attempt.decode, "session_ids": sessions(attempt.decode)},
        "attempts": [
            {
                "transfer": a.transfer,
                "prefill": a.prefill,
                "decode": a.decode,
                "state": RoomState(a.state).name,
                "reason": a.reason,
            }
            for a in room.attempts
        ],
        "node_states": attempt.node_states,
        "timestamps": room.timestamps,
        "timings": room.timings,
    }
