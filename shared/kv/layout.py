"""The shape of one KV page, and the writes that move a head range between pages.

A page holds ``page_size`` tokens of K and V for every layer, for the KV heads
its rank holds, head-major: ``(heads, layers, 2, page_size, head_dim)``.

Why this order: pages are outermost, so a run of consecutive pages is one
contiguous byte range and moves in one engine write, every layer at once, when
both ranks hold the same heads. Heads come next, so when they do not (tensor
parallelism with different sizes on the two sides) the heads one rank writes
into another are still one contiguous range of every page: one write per page.
A layer-major pool would cost one write per layer per run instead.
"""

from collections.abc import Iterable

import msgspec

# Element sizes by dtype name: the layout is plain data, so the bootstrap can check it without torch.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
DTYPE_NAMES = tuple(ITEMSIZE)


# Longer writes are cut: over TCP, pieces of this size moved faster than whole runs of
# 8 MiB and more, as the engine works on several pieces at once.
MAX_WRITE_BYTES = 4 << 20

Write = tuple[int, int, int]  # (source address, destination address, length)


def total_bytes(writes: Iterable[Write]) -> int:
    return sum(length for _, _, length in writes)


class KVLayout(msgspec.Struct, frozen=True):
    """The pages of one rank: ``num_kv_heads`` is the heads this rank holds."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_kv_heads, self.num_layers, 2, self.page_size, self.head_dim)

    @property
    def head_bytes(self) -> int:
        """One head's K and V for every layer of a page: the unit a head range is made of."""
        return self.num_layers * 2 * self.page_size * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def room_pages(self, role: str, prompt_len: int, max_new_tokens: int) -> int:
        """Pages a node holds for a room: on a prefill node the prompt's; on a decode node the
        prompt plus every token fed back. The bootstrap places rooms by this rule, nodes allocate by it."""
        return self.pages_for(prompt_len + max_new_tokens - 1 if role == "decode" else prompt_len)

    def with_heads(self, count: int) -> "KVLayout":
        return msgspec.structs.replace(self, num_kv_heads=count)


def plan_writes(
    src_base: int,
    src_page_bytes: int,
    src_pages: list[int],
    dst_base: int,
    dst_page_bytes: int,
    dst_pages: list[int],
    src_offset: int,
    dst_offset: int,
    length: int,
    max_bytes: int = MAX_WRITE_BYTES,
) -> list[Write]:
    """Writes that copy ``length`` bytes at ``src_offset`` of each source page to ``dst_offset``
    of its destination page; neighbours contiguous on both sides merge, then cut at ``max_bytes``."""
    if len(src_pages) != len(dst_pages):
        raise ValueError("source and destination page lists differ in length")
    runs: list[list[int]] = []
    for s, d in zip(src_pages, dst_pages, strict=True):
        src = src_base + s * src_page_bytes + src_offset
        dst = dst_base + d * dst_page_bytes + dst_offset
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == src and last[1] + last[2] == dst:
            last[2] += length
        else:
            runs.append([src, dst, length])
    return [
        (src + at, dst + at, min(max_bytes, total - at))
        for src, dst, total in runs
        for at in range(0, total, max_bytes)
    ]
