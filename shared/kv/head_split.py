"""How a node's tensor-parallel ranks share the attention heads, and who writes what to whom.

Each rank holds a contiguous range of query heads and of KV heads. With more
ranks than KV heads, a KV head is held by several ranks (replicated, as serving
engines do). Between a prefill node of ``Np`` ranks and a decode node of
``Nd`` ranks, every KV head a decode rank holds is written by exactly one
prefill rank holding it; where several do, the choice rotates with the decode
rank, so the writes spread over them.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRange:
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    def __contains__(self, head: object) -> bool:
        return isinstance(head, int) and self.start <= head < self.stop


def split_problem(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` ranks cannot share these heads, or None if they can."""
    if tp < 1:
        return "tensor-parallel size must be at least 1"
    if num_heads % tp:
        return f"{num_heads} query heads do not split over {tp} ranks"
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads do not group over {num_kv_heads} KV heads"
    if num_kv_heads % tp and tp % num_kv_heads:
        return f"{num_kv_heads} KV heads neither split over nor replicate onto {tp} ranks"
    return None


def query_heads(rank: int, tp: int, num_heads: int) -> HeadRange:
    per = num_heads // tp
    return HeadRange(rank * per, per)


def kv_heads(rank: int, tp: int, num_kv_heads: int) -> HeadRange:
    """The KV heads of ``rank``: a share of them, or one head held by ``tp / num_kv_heads`` ranks."""
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return HeadRange(rank * per, per)
    return HeadRange(rank * num_kv_heads // tp, 1)


def mapping_problem(ranges: Sequence[HeadRange], num_kv_heads: int) -> str | None:
    """Why a node's ranks (``ranges[r]`` for rank r) cannot be a node of this model, or None."""
    tp = len(ranges)
    if num_kv_heads % tp and tp % num_kv_heads:
        return f"{num_kv_heads} KV heads neither split over nor replicate onto {tp} ranks"
    for rank, got in enumerate(ranges):
        want = kv_heads(rank, tp, num_kv_heads)
        if got != want:
            return (
                f"rank {rank} holds KV heads [{got.start}, {got.stop}), "
                f"expected [{want.start}, {want.stop}) for {tp} ranks of {num_kv_heads} heads"
            )
    return None


def writers(prefill: Sequence[HeadRange], decode: HeadRange, decode_rank: int) -> dict[int, HeadRange]:
    """Which prefill rank writes which of ``decode``'s heads into decode rank ``decode_rank``."""
    assigned: dict[int, list[int]] = {}
    for head in range(decode.start, decode.stop):
        holders = [p for p, held in enumerate(prefill) if head in held]
        if not holders:
            raise ValueError(f"no prefill rank holds KV head {head}")
        assigned.setdefault(holders[decode_rank % len(holders)], []).append(head)
    out = {}
    for p, heads in assigned.items():
        if heads != list(range(heads[0], heads[-1] + 1)):
            raise ValueError(f"prefill rank {p} would write a non-contiguous set of heads {heads}")
        out[p] = HeadRange(heads[0], len(heads))
    return out
