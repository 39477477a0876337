"""The SUCCESS decision, from data alone: no I/O, no clock, no state of its own.

Two questions, both asked again whenever something lands:

``rank_verdict``: may this decode rank call the room ready? Only when every
prefill rank that writes into it sent done+aux, each record as it landed in
its slot is intact and names this room with the expected sizes, every page
it was to write was written (and, in verify mode, matched its digest), and
all those records agree.

``node_verdict``: what do the node's ranks agree on? The minimum of their
states (the states are ordered), a failure with the failing rank's reason,
and SUCCESS only if every rank is ready with the same record.
"""

from collections.abc import Mapping
from dataclasses import dataclass

from shared.kv.aux_buffers import Aux, unpack
from shared.room.states import FailureReason, RoomState


@dataclass(frozen=True)
class Landed:
    """One prefill rank's done+aux as it landed on this decode rank."""

    record: bytes | None  # read back from the slot; None: the done came without an aux record
    pages_written: int
    kv_intact: bool  # every page digest matched (always True with verify mode off)


@dataclass(frozen=True)
class Expected:
    """What a decode rank knows a room must deliver to it."""

    transfer: int
    prompt_len: int
    vocab_size: int
    pages: int  # KV pages each prefill rank writes into this rank
    prefill_ranks: frozenset[int]


@dataclass(frozen=True)
class Pending:
    """Not decided yet; ``corrupt`` lists ranks whose record did not arrive intact (a copy may follow)."""

    corrupt: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Ready:
    aux: Aux
    record: bytes


@dataclass(frozen=True)
class Invalid:
    reason: FailureReason
    detail: str


Verdict = Pending | Ready | Invalid


def rank_verdict(expected: Expected, landed: Mapping[int, Landed]) -> Verdict:
    for rank, got in landed.items():
        if rank not in expected.prefill_ranks:
            return Invalid(FailureReason.AUX_INVALID, f"done+aux from prefill rank {rank}, not a writer")
        if got.pages_written != expected.pages:
            return Invalid(
                FailureReason.AUX_INVALID,
                f"prefill rank {rank} wrote {got.pages_written} pages, {expected.pages} expected",
            )
        if not got.kv_intact:
            return Invalid(FailureReason.KV_CORRUPT, f"KV from prefill rank {rank} does not match its digest")
    corrupt = set()
    records: dict[int, Aux] = {}
    for rank, got in landed.items():
        aux = unpack(got.record) if got.record is not None else None
        if aux is None:
            if got.record is not None:
                corrupt.add(rank)
            continue
        if aux.transfer != expected.transfer:
            return Invalid(
                FailureReason.AUX_INVALID, f"aux holds transfer {aux.transfer}, expected {expected.transfer}"
            )
        if aux.cached_tokens != expected.prompt_len:
            return Invalid(
                FailureReason.AUX_INVALID,
                f"aux says {aux.cached_tokens} cached tokens, expected {expected.prompt_len}",
            )
        if not 0 <= aux.first_token < expected.vocab_size:
            return Invalid(FailureReason.AUX_INVALID, f"aux first token {aux.first_token} outside vocabulary")
        records[rank] = aux
    if set(records) != expected.prefill_ranks:
        return Pending(frozenset(corrupt))
    first, *others = (records[r] for r in sorted(records))
    if any(aux != first for aux in others):
        return Invalid(FailureReason.AUX_MISMATCH, "prefill ranks sent different aux records")
    return Ready(first, first.pack())


@dataclass(frozen=True)
class RankView:
    """One rank's state of a room, as it tells the node's leader."""

    state: RoomState  # SUCCESS here means ready, not yet agreed
    reason: str | None = None
    digest: int = 0  # of the ready record


def node_verdict(ranks: Mapping[int, RankView], world: int) -> tuple[RoomState, str | None]:
    """The state all ``world`` ranks agree on; a rank not heard from is still BOOTSTRAPPING."""
    failed = sorted(r for r, v in ranks.items() if v.state is RoomState.FAILED)
    if failed:
        return RoomState.FAILED, ranks[failed[0]].reason
    if len(ranks) < world:
        return RoomState.BOOTSTRAPPING, None
    state = min(v.state for v in ranks.values())
    if state is RoomState.SUCCESS and len({v.digest for v in ranks.values()}) > 1:
        return RoomState.FAILED, FailureReason.AUX_MISMATCH
    return state, None
